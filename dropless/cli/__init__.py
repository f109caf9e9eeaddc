"""The `dropless` command (also `python -m dropless`): a thin layer from options to `train`.

    dropless train                                   # tiny preset, stdlib text, CPU, ~2 min
    dropless train --preset small --steps 2000 --backend jnp --out-dir runs/small
    dropless train --config runs/small/config.yaml --model.n-routed-experts 32
    dropless train --set model.n_routed_experts=32 train.lr=1e-3
    dropless train --out-dir runs/small --resume --steps 4000
    dropless train --mesh data=2,expert=4            # sharded over 8 devices, experts over 4
    dropless train --help-all                        # every option
    dropless presets                                 # the model presets and their sizes
    dropless prepare notes/ --out data/notes         # text -> tokens (then train --data)
    dropless eval runs/small                         # loss, perplexity, bits per byte
    dropless generate runs/small --prompt "def "     # what the trained model writes
    dropless plan --preset small --batch-size 64 --seq-len 1024   # memory per device

Precedence, lowest first: the preset, a YAML `--config` (sections `preset`, `backend`, `model`,
`train`: the `config.yaml` every run writes; `--resume` reads the run's own), the flags, `--set`.
Every command is an options dataclass (`_options.TrainCommand`, `_plan.PlanCommand`, ...)
parsed by tyro through one helper (`_parsing.parse_command`), its help written from the fields'
docs (`_help`). Modules: `_options`, `_config_file` (YAML and `--set`), `_help`, `_parsing`,
`_run`; `_commands` dispatches the other subcommands (`presets`, `plan`, `evaluate`, `generate`, and
`dropless.data._cli` for prepare) and writes `dropless --help`.
"""

import sys
import warnings
from collections.abc import Sequence

from dropless._allocator import keep_freed_memory
from dropless.backends import BackendUnavailableError
from dropless.cli._commands import TRAIN, run_command
from dropless.cli._config_file import apply_overrides, load_yaml_config
from dropless.cli._launch import run_local
from dropless.cli._options import MODEL_HELP, ModelOptions, PresetsCommand, TrainCommand
from dropless.cli._parsing import parse, vocab_given
from dropless.cli._run import run_name, run_train
from dropless.train.loop._distributed import initialize_from_env

__all__ = [
    "MODEL_HELP",
    "ModelOptions",
    "PresetsCommand",
    "TrainCommand",
    "apply_overrides",
    "load_yaml_config",
    "main",
    "parse",
    "run_name",
    "vocab_given",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dropless` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # CPU training reuses its freed buffers instead of page-faulting them in afresh at every
    # step (the tiny preset's 200 steps: 21-24 s -> 18-21 s); no effect if JAX already runs
    keep_freed_memory(warn=False)
    if not args or args[0] != TRAIN[0]:
        return run_command(args)
    with warnings.catch_warnings():
        warnings.showwarning = _note  # one line, no source line
        return _main(args)


def _note(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"dropless: note: {message}", file=sys.stderr, flush=True)


def _main(args: list[str]) -> int:
    try:
        initialize_from_env()  # a process of a multi-process job joins it before JAX starts
        command = parse(args)
        if command.local_processes != 1:
            return run_local(command, args[1:])
        return run_train(command, vocab_given=vocab_given(command, args))
    except (ValueError, FileNotFoundError, BackendUnavailableError) as err:
        print(f"dropless: error: {err}", file=sys.stderr)
        return 2
