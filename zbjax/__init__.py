"""zbjax: zero-bubble and graph pipeline parallelism for JAX, as a function transform."""

from zbjax import schedules as schedules
from zbjax.errors import PartitionError as PartitionError
from zbjax.errors import PipelineError as PipelineError
from zbjax.errors import ScheduleError as ScheduleError
from zbjax.errors import ZbjaxError as ZbjaxError
from zbjax.markers import stage_boundary as stage_boundary
from zbjax.params import StagedParams as StagedParams
from zbjax.pipeline import Pipeline as Pipeline
from zbjax.pipeline import pipeline as pipeline

__version__ = "0.1.0"
