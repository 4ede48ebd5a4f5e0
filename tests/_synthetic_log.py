"""A hand-written hookscope log that follows docs/log-format.md, for report tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

MODULES = {"conv": "Conv2d", "bn": "BatchNorm2d", "relu": "ReLU", "fc": "Linear"}
PARAMS = {
    "conv.weight": [4, 1, 3, 3],
    "conv.bias": [4],
    "bn.weight": [4],
    "bn.bias": [4],
    "fc.weight": [10, 64],
    "fc.bias": [10],
}


def _json(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


def write_log(log_dir: Path, *, steps: int = 30, every: int = 5) -> Path:
    """Write ``log_dir/hookscope.jsonl`` with a NaN finding, histograms and feature maps."""
    log_dir.mkdir(parents=True, exist_ok=True)
    recs: list[dict] = [
        {
            "type": "header",
            "format": "hookscope-log",
            "version": 1,
            "hookscope": "0.1.0",
            "model": "TinyNet",
            "modules": MODULES,
            "params": PARAMS,
            "settings": {"every": every},
            "time": 0.0,
        },
    ]
    for step in range(steps):
        rec: dict = {
            "type": "step",
            "step": step,
            "time": float(step),
            "sampled": step % every == 0,
            "training": True,
            "scalars": {"loss": 2.3 * math.exp(-step / 10), "lr": 0.1 * 0.9**step},
        }
        if rec["sampled"]:
            rec["act"] = {
                name: {
                    "mean": 0.1 * i + 0.01 * step,
                    "std": 1.0 / (1 + i),
                    "min": -1.0,
                    "max": 1.0,
                    "absmax": 1.0,
                    "zero_frac": 0.5 if name == "relu" else 0.0,
                    "sat_frac": 0.0,
                    "nan": 0,
                    "inf": 0,
                    "numel": 256,
                    "hist": {
                        "lo": -1.0 - step / 30,
                        "hi": 1.0,
                        "counts": [1, 4, 9, 16, 9, 4, 1, 0],
                    },
                }
                for i, name in enumerate(MODULES)
            }
            rec["grad"] = {
                name: {"norm": 10.0 ** (-i - step / 10), "absmax": 0.1, "nan": 0, "inf": 0}
                for i, name in enumerate(MODULES)
            }
            rec["param"] = {
                name: {"norm": 1.0, "grad_norm": 0.1, "update_ratio": 1e-3 * (1 + step / 10)}
                for name in PARAMS
            }
            rec["bn"] = {
                "bn": {
                    "running_mean": 0.0,
                    "running_var": 1.0,
                    "mean_drift": 0.01,
                    "var_drift": 0.02,
                }
            }
        if step == 12:
            rec["scalars"]["loss"] = math.nan
        recs.append(rec)
        if step == 12:
            recs.append(
                {
                    "type": "finding",
                    "kind": "nonfinite",
                    "module": "bn",
                    "step": 12,
                    "value": math.nan,
                    "message": "bn output held 3 NaN values while its inputs were finite",
                }
            )
            recs.append(
                {"type": "event", "step": 12, "kind": "skipped_step", "message": "loss was nan"}
            )
    recs.append(
        {
            "type": "feature_maps",
            "step": steps - 1,
            "module": "conv",
            "shape": [4, 8, 8],
            "data": [
                [[math.sin(c + x * y / 7) for x in range(8)] for y in range(8)] for c in range(4)
            ],
        }
    )
    recs.append(
        {
            "type": "summary",
            "rows": [
                {
                    "name": "",
                    "type": "TinyNet",
                    "input_shape": [[2, 1, 8, 8]],
                    "output_shape": [[2, 10]],
                    "params": 714,
                    "trainable": 714,
                    "bytes": 80,
                },
                {
                    "name": "conv",
                    "type": "Conv2d",
                    "input_shape": [[2, 1, 8, 8]],
                    "output_shape": [[2, 4, 8, 8]],
                    "params": 40,
                    "trainable": 40,
                    "bytes": 2048,
                },
                {
                    "name": "fc",
                    "type": "Linear",
                    "input_shape": [[2, 64]],
                    "output_shape": [[2, 10]],
                    "params": 650,
                    "trainable": 650,
                    "bytes": 80,
                },
            ],
            "total": {"params": 714, "trainable": 714, "bytes": 2128},
        }
    )
    path = log_dir / "hookscope.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(_json(rec)) + "\n")
    return path
