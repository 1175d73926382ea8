"""Sensors and schedules that start batch runs without anyone clicking, and tell people after."""

from .batch_completion import build_batch_completion_sensor  # issue 13
from .new_tables import build_new_input_tables_sensor
from .notifications import build_run_notification_sensors, format_message
from .schedules import build_latest_partition_schedule

__all__ = [
    "build_batch_completion_sensor",
    "build_latest_partition_schedule",
    "build_new_input_tables_sensor",
    "build_run_notification_sensors",
    "format_message",
]
