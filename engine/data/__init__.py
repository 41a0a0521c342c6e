"""The data pipeline: tokenizers, indexed (mmap) datasets, preprocessing, GPT samples, blending.

tokenizer.py        byte | hf:PATH | sentencepiece:PATH behind one interface (vocab_size, eod, encode, decode)
indexed_dataset.py  PREFIX.bin/.idx: the writer (streaming) and the memory-mapped reader
preprocess.py       text/jsonl files -> an indexed dataset (`elastron preprocess`)
gpt_dataset.py      seq_length + 1 token samples across documents, shuffled per epoch, index cached
blending.py         exact greedy blending of datasets; train/valid/test document splits
builder.py          the job's data section -> train/valid/test sources
sources.py          TokenSource (a source's own micro_batch), TextSource, SyntheticSource (samples by global index)
"""
