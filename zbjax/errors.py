"""Exceptions raised by zbjax: each message says what was wrong and what to do instead."""

from __future__ import annotations


class ZbjaxError(Exception):
    """Base class of every error zbjax raises on purpose."""


class ScheduleError(ZbjaxError, ValueError):
    """A schedule (or a request for one) breaks a rule; the message names the rule and action."""


class PartitionError(ZbjaxError, ValueError):
    """The traced program cannot be cut into stages as asked."""


class PipelineError(ZbjaxError, ValueError):
    """The pipeline was given inputs (params, batch, mesh, options) that do not fit."""
