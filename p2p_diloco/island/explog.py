"""Optional experiment logging of one island: Weights & Biases (``--wandb-project``) and TensorBoard
(``--tensorboard-dir``), under the metric names the dashboard uses (:data:`records.METRICS`).

Each island logs its own progress record whenever it publishes one (every ``--progress-period``
seconds) and once more at the end, with the inner step as the step. A W&B run is named after the
island and grouped by run id; ``--wandb-mode offline`` writes it locally without network (upload it
later with ``wandb sync``). TensorBoard files go to ``<tensorboard-dir>/<run-id>/<island>/``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

from p2p_diloco.errors import ConfigError
from p2p_diloco.net.records import IslandProgress, island_metrics

logger = logging.getLogger(__name__)


class ExperimentLog:
    """Logs an island's metrics to W&B and/or TensorBoard; does nothing when neither is asked for.

    :param config: the run's configuration, stored with the W&B run
    :raises ConfigError: the package is not installed, W&B cannot start a run (no network or no API
        key in online mode), or the TensorBoard folder cannot be written
    """

    def __init__(self, *, run_id: str, island: str, config: dict, wandb_project: str = "", wandb_mode: str = "",
                 tensorboard_dir: str = ""):
        self.run, self.writer = None, None
        self._last: Optional[tuple] = None
        self._lock = threading.Lock()  # the reporter thread and the island's shutdown both log
        self._failed = False
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ConfigError("--wandb-project needs the wandb package: pip install 'p2p-diloco[wandb]'") from None
            try:
                self.run = wandb.init(project=wandb_project, name=island, group=run_id, config=config,
                                      mode=wandb_mode or None, settings=wandb.Settings(console="off", quiet=True))
            except Exception as e:
                raise ConfigError(f"--wandb-project {wandb_project}: W&B could not start a run ({e}); without network "
                                  "or an API key, pass --wandb-mode offline (upload later with `wandb sync`)") from None
            logger.info("logging to W&B project %s (%s mode), run %s", wandb_project, self.run.settings.mode, island)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.close()
                raise ConfigError("--tensorboard-dir needs the tensorboard package: "
                                  "pip install 'p2p-diloco[tensorboard]'") from None
            folder = os.path.join(tensorboard_dir, run_id, island)
            try:
                self.writer = SummaryWriter(log_dir=folder)
            except OSError as e:
                self.close()
                raise ConfigError(f"--tensorboard-dir {tensorboard_dir}: cannot write ({e.strerror or e})") from None
            logger.info("logging to TensorBoard in %s", folder)

    @property
    def enabled(self) -> bool:
        return self.run is not None or self.writer is not None

    def log(self, record: IslandProgress) -> None:
        """Log a record's metrics at its inner step (a record equal to the last one logged is skipped).
        Never raises: a logging failure is reported once and must not stop the island's records."""
        if not self.enabled:
            return
        metrics = island_metrics(record.dict())
        key = (record.inner_step, metrics.get("eval_loss"))
        with self._lock:
            if key == self._last:
                return
            self._last = key
            try:
                if self.run is not None:
                    self.run.log(metrics, step=record.inner_step)
                if self.writer is not None:
                    for name, value in metrics.items():
                        self.writer.add_scalar(name, value, global_step=record.inner_step, walltime=record.time)
            except Exception as e:
                if not self._failed:
                    logger.warning("experiment logging failed (the island goes on): %r", e)
                self._failed = True

    def close(self) -> None:
        """Flush and finish (the W&B run is marked finished; its service process ends)."""
        with self._lock:
            if self.writer is not None:
                self.writer.close()
                self.writer = None
            if self.run is not None:
                self.run.finish()
                self.run = None
