"""Pipeline parallelism: which layers each (virtual) stage holds, and the microbatch schedules."""

from engine.pipeline_parallel.schedules import PipelineRunner, stage_layer_ranges, virtual_stages_of

__all__ = ["PipelineRunner", "stage_layer_ranges", "virtual_stages_of"]
