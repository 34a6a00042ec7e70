"""Pipeline parallelism the GSPMD way: stages vectorised on a stage dim split over a mesh
axis, shifts between stages as collective-permutes, one SPMD program.

forward.py    gt.pipeline: the forward (GPipe, or circular with virtual stages); TF's
              gradient of its loop is the reversed pipeline
one_f_one_b.py the 1F1B loop: forward and backward interleaved, stage inputs stashed
value_and_grad.py gt.pipeline_value_and_grad: mean loss and stage-param gradients
schedule.py   who runs what when (shared by the loops and gt.pipeline_schedule)
"""

from gspmd_tf.pipeline.forward import pipeline
from gspmd_tf.pipeline.schedule import PipelineSchedule, layer_order, pipeline_schedule
from gspmd_tf.pipeline.value_and_grad import pipeline_value_and_grad

__all__ = ["PipelineSchedule", "layer_order", "pipeline", "pipeline_schedule",
           "pipeline_value_and_grad"]
