"""zbjax: zero-bubble and graph pipeline parallelism for JAX, as a function transform."""

from zbjax import schedules as schedules
from zbjax.errors import PartitionError as PartitionError
from zbjax.errors import PipelineError as PipelineError
from zbjax.errors import ScheduleError as ScheduleError
from zbjax.errors import ZbjaxError as ZbjaxError
from zbjax.executor import run_schedule as run_schedule
from zbjax.graphpipe import GraphPartition as GraphPartition
from zbjax.graphpipe import OpGraph as OpGraph
from zbjax.graphpipe import OpNode as OpNode
from zbjax.graphpipe import chain_partition as chain_partition
from zbjax.graphpipe import graph_partition as graph_partition
from zbjax.markers import stage_boundary as stage_boundary
from zbjax.microbatch import microbatch_keys as microbatch_keys
from zbjax.microbatch import reference_value_and_grad as reference_value_and_grad
from zbjax.microbatch import split_microbatches as split_microbatches
from zbjax.optim import StagedState as StagedState
from zbjax.params import StagedParams as StagedParams
from zbjax.partition import partition as partition
from zbjax.partition import stage_summary as stage_summary
from zbjax.pipeline import Buffers as Buffers
from zbjax.pipeline import Pipeline as Pipeline
from zbjax.pipeline import pipeline as pipeline

__version__ = "0.1.0"
