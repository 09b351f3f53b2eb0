"""The weight-update barrier: pause engines ▸ the trainer pushes its weights ▸ policy version += 1 ▸ resume."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import anyio
import structlog

from rollflow.config import RunConfig
from rollflow.errors import WeightSyncTimeoutError, is_retryable
from rollflow.inference.client import InferenceClient, PauseMode

if TYPE_CHECKING:
    from rollflow.weights import WeightPusher, WeightSource, WeightTransfer

log = structlog.get_logger(__name__)

#: The push phase's own deadline is ``timeout_s`` plus this: the transfer's timeouts (the same ``timeout_s``)
#: fire first and name what was still pending (servers, trainer rank); this one only catches a transfer that
#: does not bound itself.
PUSH_BACKSTOP_GRACE_S = 1.0


class WeightBarrier:
    """Moves new weights into the inference engines between generation phases: pause ▸ the trainer pushes ▸
    resume, each phase bounded by ``timeout_s``.

    The weights travel by a ``rollflow.weights.WeightTransfer`` (in-process copy, broadcast, checkpoint…)
    whose control half runs here while its transport half runs where the weights are (the trainer's
    ``push_weights``). The engines are resumed whatever happens during the transfer (timeout, error,
    cancellation), so a failed update never leaves them paused.
    """

    def __init__(self, client: InferenceClient, transfer: WeightTransfer, *, timeout_s: float):
        self.client = client
        #: Where pause, resume and the transfer's server calls go (``client.control``).
        self.control = client.control
        self.transfer = transfer
        self.timeout_s = timeout_s

    @classmethod
    def from_config(
        cls, config: RunConfig, client: InferenceClient, rank0_address: str = "127.0.0.1"
    ) -> WeightBarrier:
        """The barrier a run uses: ``weight_sync``'s strategy (resolved for the inference mode and engine);
        ``rank0_address``, the trainer rank 0's node, is ``weight_sync.master_address = "auto"``."""
        from rollflow.weights import WeightTransfer, strategy_from_config

        sync = config.weight_sync
        strategy = sync.resolved_strategy(config.inference.mode)
        if config.inference.colocate and sync.strategy == "auto" and _colocated_on_cuda(config):
            strategy = "cuda_ipc"  # trainer and servers share the GPU: hand the buffers over, no copy
        master_address = rank0_address if sync.master_address == "auto" else sync.master_address
        if config.trainer.lora is not None and config.inference.engine == "vllm":
            # vLLM takes an adapter through its LoRA API (one adapter per version), not as weights.
            from rollflow.inference.setup import lora_versions_kept
            from rollflow.weights.vllm_lora import VllmLoraStrategy

            options = VllmLoraStrategy.options_from(sync, engine="vllm", master_address=master_address)
            return cls(
                client,
                WeightTransfer(VllmLoraStrategy(**options, keep_versions=lora_versions_kept(config))),
                timeout_s=sync.timeout_s,
            )
        transfer = WeightTransfer(
            strategy_from_config(
                strategy, sync, engine=config.inference.engine, master_address=master_address
            )
        )
        return cls(client, transfer, timeout_s=sync.timeout_s)

    async def update(
        self, trainer: WeightPusher | WeightSource, policy_version: int, pause_mode: PauseMode
    ) -> dict[str, float]:
        """Have ``trainer`` (a handle with ``push_weights``, e.g. ``Trainer``, ``TrainerProcess``,
        ``rollflow.weights.StaticWeights``) push its weights as ``policy_version``; returns the barrier's
        timings in seconds (``barrier_time_s`` in all, of which ``pause_time_s`` and ``transfer_time_s``, and
        of that ``delivery_check_time_s`` when the transfer proves its delivery).

        Raises:
            WeightSyncTimeoutError: pausing, the push or resuming took longer than ``timeout_s`` (the message
                names the phase, and the servers or trainer rank still pending).
            Exception: what the transfer raised, naming the server or trainer rank (the next update
                reconnects): at once when it is not retryable (``rollflow.errors.is_retryable``: a timeout, a
                malformed transfer info, a 4xx, a dead trainer process) or blames a server still in use, else
                after one failed retry.
        """
        started = time.perf_counter()
        try:
            await self._phase(
                "pausing the engines", policy_version, self.control.pause(pause_mode), self.timeout_s
            )
            paused_at = time.perf_counter()
            await self._phase(
                "the trainer's push",
                policy_version,
                self._push(trainer, policy_version),
                self.timeout_s + PUSH_BACKSTOP_GRACE_S,
            )
            transferred_at = time.perf_counter()
        except BaseException:
            try:
                await self._resume(policy_version, raise_on_timeout=False)
            except Exception as error:  # the push's error is the one to report
                log.warning("resuming the engines after a failed weight update failed", error=str(error))
            raise
        await self._resume(policy_version, raise_on_timeout=True)
        resumed_at = time.perf_counter()
        # A value probe needs the engines serving (it generates), so it comes after the resume; a failed one
        # stops the run before this version trains.
        await self._phase(
            "the value probe",
            policy_version,
            self.transfer.verify(self.control, trainer, policy_version),
            self.timeout_s,
        )
        timings = {
            "barrier_time_s": resumed_at - started,
            "pause_time_s": paused_at - started,
            "transfer_time_s": transferred_at - paused_at,
        }
        checked = getattr(self.transfer, "delivery_check_s", None)
        if checked is not None:  # part of the transfer: the servers showed what they serve
            timings["delivery_check_time_s"] = checked
        probed = getattr(self.transfer, "probe_logprob_diff", None)
        if probed is not None:
            timings["probe_time_s"] = time.perf_counter() - resumed_at
            timings["probe_logprob_diff"] = probed
        log.debug("weights updated", policy_version=policy_version, **timings)
        return timings

    async def _push(self, trainer: WeightPusher | WeightSource, policy_version: int) -> None:
        try:
            await self.transfer.push(self.control, trainer, policy_version)
        except Exception as error:
            if not is_retryable(error):
                raise
            failed_servers = [url for url in getattr(error, "failures", {}) if url in self._server_urls()]
            if failed_servers:
                # The same servers would fail the retry, some only after blocking on the dead one until
                # their own timeout: report them now.
                raise
            # A server died mid-transfer and the client dropped it (the transfer reconnects with the servers
            # that are left, a new world size), or the trainer side's transport failed. One retry; a second
            # failure is real.
            log.warning("weight transfer failed; reconnecting and retrying once", error=str(error))
            await self.transfer.push(self.control, trainer, policy_version)

    def _server_urls(self) -> list[str]:
        return list(self.control.server_urls)

    async def _phase(self, what: str, policy_version: int, work: Awaitable[None], timeout_s: float) -> None:
        try:
            with anyio.fail_after(timeout_s):
                await work
        except TimeoutError as error:
            raise WeightSyncTimeoutError(
                f"weight update to policy version {policy_version}: {what} took longer than "
                f"weight_sync.timeout_s = {self.timeout_s} s ({error or 'no reply'}); the engines were resumed"
            ) from None

    async def _resume(self, policy_version: int, *, raise_on_timeout: bool) -> None:
        # Shielded so a cancelled run still resumes its engines; bounded so a dead engine cannot hang us.
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout_s) as scope:
            await self.control.resume()
        if scope.cancelled_caught and raise_on_timeout:
            raise WeightSyncTimeoutError(
                f"weight update to policy version {policy_version}: resuming the engines took longer than "
                f"weight_sync.timeout_s = {self.timeout_s} s; they may still be paused"
            )

    def close(self) -> None:
        self.transfer.close()


def _colocated_on_cuda(config: RunConfig) -> bool:
    """Whether the trainer and the servers rollflow starts both run on CUDA (then colocated weights go by IPC)."""
    from rollflow.models.loading import resolve_device

    if resolve_device(config.trainer.device, "trainer.device").type != "cuda":
        return False
    if config.inference.engine == "vllm":
        return True
    return resolve_device(config.inference.device, "inference.device").type == "cuda"
