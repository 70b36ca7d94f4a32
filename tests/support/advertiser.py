"""A stand-in for the engines' connector plugin on kwok: FAKE, named as such.

kwok runs no containers, so no engine ever advertises itself in its deployment's rendezvous, and a rollout (which
drains old engines only once new ones are advertised) would wait forever. This does what each engine's plugin does,
for every engine pod of a namespace: once the pod is Ready, register it in a real rendezvous with its pod name and
UID, role, deployment and the layout key its engine container was given; when it stops being Ready, starts
terminating or is deleted, deregister it (the plugin's SIGTERM handler).
"""
from __future__ import annotations

import asyncio
import threading

from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Pod

from disagg.connector.rendezvous.client import RendezvousClient
from disagg.connector.wire import env as wire_env
from support.kube import pod_ready
from support.rendezvous import advert


class StandInAdvertiser:
    def __init__(self, kubeconfig, namespace: str, rendezvous_url: str, token: str) -> None:
        self.kubeconfig, self.namespace, self.url, self.token = kubeconfig, namespace, rendezvous_url, token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="stand-in-advertiser")
        self._task: asyncio.Future | None = None

    def start(self) -> StandInAdvertiser:
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _run(self) -> None:
        client = AsyncClient(KubeConfig.from_file(self.kubeconfig))
        registered: dict[str, str] = {}  # pod name -> engine id
        async with RendezvousClient(self.url, token=self.token) as rendezvous:
            while True:
                try:
                    async for op, pod in client.watch(Pod, namespace=self.namespace,
                                                      labels={"app.kubernetes.io/managed-by": "disagg-operator"}):
                        await self._handle(rendezvous, registered, op, pod)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a watch that ends or fails is started again, as a plugin would retry
                    await asyncio.sleep(0.2)

    async def _handle(self, rendezvous: RendezvousClient, registered: dict[str, str], op: str, pod: Pod) -> None:
        labels = pod.metadata.labels or {}
        role = labels.get("app.kubernetes.io/component")
        if role not in ("prefill", "decode"):
            return
        name, uid = pod.metadata.name, pod.metadata.uid
        serving = op != "DELETED" and pod.metadata.deletionTimestamp is None and pod_ready(pod)
        if serving and name not in registered:
            env = {e.name: e.value for e in pod.spec.containers[0].env or [] if e.value is not None}
            engine_id = f"{name}-{uid[:8]}"
            ip = (pod.status.podIP if pod.status else None) or "10.0.0.1"
            await rendezvous.register(advert(
                engine_id, role=role, deployment=labels["app.kubernetes.io/instance"], pod_name=name, pod_uid=uid,
                layout_key=env.get(wire_env.LAYOUT_KEY, "unknown"), http_url=f"http://{ip}:8000",
                side_channel_host=ip, lease_seconds=600))
            registered[name] = engine_id
        elif not serving and name in registered:
            await rendezvous.deregister(registered.pop(name))
