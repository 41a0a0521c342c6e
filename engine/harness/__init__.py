"""lm-evaluation-harness on our engine: a checkpoint scored where it is, on the layout asked for.

lm-eval defines the tasks, their prompts and metrics; this package joins it to the engine:
- `forward.py`: forward-only passes of a Trainer's model on any TP / SP / PP / DP layout, rows of
  token ids in, whatever a caller reduces each row's logits to out, the same on every rank;
- `backend.py`: lm-eval's `TemplateLM` (loglikelihood, rolling loglikelihood, greedy
  generation) on top of it, scoring as lm-eval's own Hugging Face backend does;
- `tasks.py`: task names resolved against the tasks shipped here (local JSON data), a user's
  task folders and lm-eval's registry, refusing any task that would download from a hub;
- `checkpoint_eval.py`: a committed checkpoint (local or S3, any layout saved) loaded on the
  asked layout through the Trainer's own resume, and `elastron eval`'s run on N local ranks.
"""
