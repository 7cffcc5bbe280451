"""What a CLI job shows on the console: flexgemma's own lines, and errors from anywhere. Warnings of
other libraries (transformers' FutureWarnings, TRL's experimental-API notice, bitsandbytes' optional
kernels) go to the job's log file only (<job dir>/flexgemma.log), where nothing is lost.

Only the CLI's task function routes them (flexgemma.run.job.hydra_task): a program that imports
flexgemma keeps its own warning and logging setup.
"""

from __future__ import annotations

import logging
import warnings

from flexgemma.config.schema import FlexgemmaWarning

# loggers whose records reach the console below ERROR: flexgemma's, Hydra's and its launchers'
_OWN = ("flexgemma", "hydra", "hydra_plugins", "__main__")


def _console_filter(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or record.name.split(".")[0] in _OWN


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for a CLI job: flexgemma's warnings on its logger (console and file),
    every other one on py.warnings (the log file only)."""
    if issubclass(category, FlexgemmaWarning):
        logging.getLogger("flexgemma").warning("%s", message)
    else:
        logging.getLogger("py.warnings").warning("%s", warnings.formatwarning(message, category, filename, lineno,
                                                                                 line).rstrip())


def route_third_party_to_log_file() -> None:
    """Keeps other libraries' warnings and log records below ERROR off the console of this job and in
    its log file. Without a log file (Hydra's file logging off) nothing changes."""
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) for h in root.handlers):
        return
    for h in root.handlers:
        if not isinstance(h, logging.FileHandler) and _console_filter not in h.filters:
            h.addFilter(_console_filter)
    warnings.showwarning = _show_warning
    try:  # transformers logs through its own stderr handler unless told to propagate
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    except ImportError:
        pass
