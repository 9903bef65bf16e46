"""What a model directory's `completiond.json` says about the model, read once when it loads.

The file is written by the bundled model's training command; other models have
none. Its presence marks the bundled FIM family (whose vocabulary looks like
Qwen's, so the vocabulary alone cannot tell them apart). The engine reads it in
`Engine.load` and passes the record down: the prompt builder budgets against
`train_context` and takes `fim_template`, calibration falls back to `speculation`, and the weights setting
"auto" takes `cpu_weights` on the CPU.

Torch-free. The file is data only: nothing in it is ever evaluated.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from completiond.fileio import UnsafeFile, read_file

INFO_FILE = "completiond.json"
INFO_LIMIT = 1 << 20  # the bundled model's is 1 kB
CPU_WEIGHTS = ("bf16", "int8")  # formats a record may choose (native.WEIGHT_FORMATS less "auto")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    path: Path | None = None  # the file it was read from; None: the model has none
    train_context: int | None = None  # longest context seen in training (prompts stay within it)
    fim_template: str | None = None  # the FIM family the file marks ("completiond"), else None
    speculation: dict[str, Any] | None = None  # shipped speculation defaults (a Calibration record)
    # The languages the model was trained on, as editors name them ("python"); None: not said (any).
    languages: tuple[str, ...] | None = None
    # The native CPU step's weight format where the weights setting is "auto" (None: the checkpoint's own values).
    # A model's record names one only where its quality in that format was measured (`bench --quality`).
    cpu_weights: str | None = None

    @classmethod
    def read(cls, model_dir: str | Path | None) -> "ModelInfo":
        if model_dir is None:
            return cls()
        path = Path(model_dir) / INFO_FILE
        try:
            data = json.loads(read_file(path, INFO_LIMIT).decode("utf-8"))
        except FileNotFoundError:
            return cls()
        except UnsafeFile:
            raise  # a device, FIFO or huge file is no damaged record: the load stops and says why
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
            # A damaged file must not stop the model from loading; it still marks the family.
            log.warning("ignoring the contents of %s: %s", path, exc)
            data = {}
        if not isinstance(data, dict):
            log.warning("ignoring the contents of %s: not a JSON object", path)
            data = {}
        context = data.get("train_context")
        speculation = data.get("speculation")
        languages = data.get("languages")
        cpu_weights = data.get("cpu_weights")
        if cpu_weights is not None and cpu_weights not in CPU_WEIGHTS:
            log.warning('ignoring "cpu_weights" in %s: expected one of %s', path, ", ".join(CPU_WEIGHTS))
            cpu_weights = None
        if languages is not None and not (
            isinstance(languages, list) and languages and all(isinstance(x, str) and x for x in languages)
        ):
            log.warning('ignoring "languages" in %s: expected a list of language ids', path)
            languages = None
        return cls(
            path=path,
            train_context=context
            if isinstance(context, int) and not isinstance(context, bool) and context > 0
            else None,
            fim_template="completiond",
            speculation=speculation if isinstance(speculation, dict) else None,
            languages=tuple(x.lower() for x in languages) if languages else None,
            cpu_weights=cpu_weights,
        )
