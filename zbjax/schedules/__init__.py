"""Pipeline schedules as plain data: build, validate, simulate and draw (these modules import
no JAX; the ``zbjax`` package around them does)."""

from zbjax.schedules.auto import zb_auto as zb_auto
from zbjax.schedules.dag import dag_1f1b as dag_1f1b
from zbjax.schedules.dag import dag_zb as dag_zb
from zbjax.schedules.generators import v_placement as v_placement
from zbjax.schedules.ir import KINDS as KINDS
from zbjax.schedules.ir import Action as Action
from zbjax.schedules.ir import Costs as Costs
from zbjax.schedules.ir import Schedule as Schedule
from zbjax.schedules.ir import SimResult as SimResult
from zbjax.schedules.ir import chain_edges as chain_edges
from zbjax.schedules.ir import parse_actions as parse_actions
from zbjax.schedules.plot import chrome_trace as chrome_trace
from zbjax.schedules.plot import gantt as gantt
from zbjax.schedules.plot import text_grid as text_grid
from zbjax.schedules.plot import write_trace as write_trace
from zbjax.schedules.registry import DAG_SCHEDULE_NAMES as DAG_SCHEDULE_NAMES
from zbjax.schedules.registry import SCHEDULE_NAMES as SCHEDULE_NAMES
from zbjax.schedules.registry import build as build
from zbjax.schedules.registry import check_options as check_options
from zbjax.schedules.simulate import backward_kinds as backward_kinds
from zbjax.schedules.simulate import dependencies as dependencies
from zbjax.schedules.simulate import memory_delta as memory_delta
from zbjax.schedules.simulate import peak_memory as peak_memory
from zbjax.schedules.simulate import simulate as simulate
from zbjax.schedules.simulate import span_bubble_rate as span_bubble_rate
from zbjax.schedules.validate import validate as validate
