"""The scaling model of DDP data-parallel training (python -m common.tools.scaling;
docs/scaling.md): predicted step time, per-GPU throughput and scaling
efficiency from 1 to 1,024 GPUs for each DDP communication hook.

By job:
  model         the model's gradients, DDP's buckets, the hooks' bytes, ring
                all-reduce over the links, the step at each GPU count
  inputs        a measured step from a run directory or a bench CSV, links
                from a comm CSV, measured efficiencies from run logs
  presets       --preset: Validation A (the 2020 V100 runs) and H100 nodes
  report        the CSV, the text summary and the figure
  command_line  the flags and main (__main__ runs it)

The names below are the package's API for the other tools (link_validation,
bench, comm_bench) and the tests; each is defined in one module above.
"""
from common.tools.scaling.command_line import build_parser, main
from common.tools.scaling.inputs import (links_from_comm_csv, measured_efficiencies, settings_from_bench,
                                         settings_from_run)
from common.tools.scaling.model import (DATA_LAYOUTS, DEFAULT_GPUS, HOOKS, MIB, Bucket, Gradient, Links, ModelProfile, Settings,
                                        StepPrediction, assign_buckets, bus_bandwidth, collective_bytes,
                                        ddp_bucket_caps, gbps_to_bytes, predict, predict_step, profile_model,
                                        ring_allreduce_ms, solve_compute_ms, supply_ms_by_epoch)
from common.tools.scaling.presets import H100_LINKS, HAL_LINKS, PRESETS, preset
from common.tools.scaling.report import CSV_COLUMNS, attach_measured, draw_figure, summary_lines, write_csv_new

__all__ = ["build_parser", "main", "links_from_comm_csv", "measured_efficiencies", "settings_from_bench",
           "settings_from_run", "DATA_LAYOUTS", "DEFAULT_GPUS", "HOOKS", "MIB", "Bucket", "Gradient", "Links", "ModelProfile",
           "Settings", "StepPrediction", "assign_buckets", "bus_bandwidth", "collective_bytes", "ddp_bucket_caps",
           "gbps_to_bytes", "predict", "predict_step", "profile_model", "ring_allreduce_ms", "solve_compute_ms", "supply_ms_by_epoch",
           "H100_LINKS", "HAL_LINKS", "PRESETS", "preset", "CSV_COLUMNS", "attach_measured", "draw_figure",
           "summary_lines", "write_csv_new"]
