"""The driver's StateStoreCoordinator and its typed client, StateStoreCoordinatorRef
(docs/spark-state-store.md, The registry and the coordinator).

The coordinator records which executor holds the *active* instance of each state store
provider, keyed by :class:`~statecore.StateStoreProviderId`. Executors report every load
(``ReportActiveInstance``) and ask during maintenance whether their instance is still the
active one (``VerifyIfInstanceActive``); the driver asks where a store is loaded
(``GetLocation``, for preferred locations) and forgets a query's instances when it stops
(``DeactivateInstances``).

Every message is request/reply, as in Spark since 3.2. The messages are the
:class:`~statecore.rpc.Message` Structs below, and the endpoint takes exactly their union,
:data:`CoordinatorMessage` (anything else drops the sender's connection: see
:mod:`statecore.rpc`); a provider id travels as a :class:`ProviderId`, made and read by
:func:`provider_id_to_message` and :func:`provider_id_from_message`, the one place that
conversion is defined. A report checks at most :data:`REPORT_IDS_PER_MESSAGE` ids in one
message (a longer one does not decode, so one report holds the endpoint for a bounded time);
the ref splits a longer list over several reports.

Thread-safety: the endpoint is driven by :mod:`statecore.rpc`, which hands it one message at
a time, so it keeps no lock; do not call its handlers from several threads yourself. A
:class:`StateStoreCoordinatorRef` may be shared by threads and pickled into tasks.
"""
import logging
import uuid
from typing import Annotated, Optional, Union

import msgspec

from statecore import rpc
from statecore.errors import EndpointAlreadyRegisteredError
from statecore.ids import StateStoreId, StateStoreProviderId

__all__ = ["ENDPOINT_NAME", "REPORT_IDS_PER_MESSAGE", "StateStoreCoordinator", "StateStoreCoordinatorRef",
           "executor_location",
           "parse_executor_location", "executor_of", "same_executor",
           "provider_id_from_message", "provider_id_to_message", "ProviderId", "CoordinatorMessage",
           "ReportActiveInstance", "VerifyIfInstanceActive", "GetLocation", "DeactivateInstances", "StopCoordinator"]

log = logging.getLogger(__name__)

ENDPOINT_NAME = "StateStoreCoordinator"
REPORT_IDS_PER_MESSAGE = 4096  # provider ids one ReportActiveInstance checks (docs/rpc.md, Messages)


# -- messages ----------------------------------------------------------------------------------

class ProviderId(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """A StateStoreProviderId on the wire: ``[root, operator, partition, store name, run id]``;
    also the coordinator's key (hashable, equal when the provider ids are). Its fields hold no
    references to containers, so the garbage collector need not track it (``gc=False``)."""

    checkpoint_root_location: str
    operator_id: int
    partition_id: int
    store_name: str
    query_run_id: uuid.UUID


class ReportActiveInstance(rpc.Message):
    """This executor loaded ``provider_id``; the reply lists those of ``provider_ids_to_check``
    that are active on another executor (at most REPORT_IDS_PER_MESSAGE of them)."""

    provider_id: ProviderId
    host: str
    executor_id: str
    provider_ids_to_check: Annotated[list[ProviderId], msgspec.Meta(max_length=REPORT_IDS_PER_MESSAGE)]


class VerifyIfInstanceActive(rpc.Message):
    """Whether ``executor_id`` holds the active instance of ``provider_id`` (a bool)."""

    provider_id: ProviderId
    executor_id: str


class GetLocation(rpc.Message):
    """Where the active instance of ``provider_id`` is (a location string, or None)."""

    provider_id: ProviderId


class DeactivateInstances(rpc.Message):
    """Forget every instance of the query run ``run_id`` (replies True)."""

    run_id: uuid.UUID


class StopCoordinator(rpc.Message):
    """Unregister the coordinator (replies True once its name is free)."""


CoordinatorMessage = Union[ReportActiveInstance, VerifyIfInstanceActive, GetLocation, DeactivateInstances,
                           StopCoordinator]
_PROVIDER_IDS = list[ProviderId]  # the reply types the ref asks for
_LOCATION = Optional[str]


def provider_id_to_message(provider_id):
    """A provider id as a :class:`ProviderId`."""
    if not isinstance(provider_id, StateStoreProviderId):
        raise TypeError(f"expected a StateStoreProviderId, got {type(provider_id).__name__}")
    store_id = provider_id.store_id
    return ProviderId(store_id.checkpoint_root_location, store_id.operator_id, store_id.partition_id,
                      store_id.store_name, provider_id.query_run_id)


def provider_id_from_message(message):
    """The provider id of a :class:`ProviderId` (ValueError if its fields make none)."""
    if not isinstance(message, ProviderId):
        raise TypeError(f"expected a ProviderId, got {type(message).__name__}")
    store_id = StateStoreId(message.checkpoint_root_location, message.operator_id, message.partition_id,
                            message.store_name)
    return StateStoreProviderId(store_id, message.query_run_id)


def executor_location(host, executor_id):
    """Spark's ``ExecutorCacheTaskLocation`` string, ``"executor_<host>_<executor_id>"``.

    Spark's scheduler parses it back by splitting on the first ``_`` after the prefix, so a
    host with ``_`` in it would be read as another host: refused here, when it is reported.
    """
    if not isinstance(host, str) or not isinstance(executor_id, str):
        raise TypeError(f"host and executor_id must be str, got {type(host).__name__} and "
                        f"{type(executor_id).__name__}")
    if "_" in host:
        raise ValueError(f"host name {host!r} contains '_': Spark splits the location "
                         f"'executor_<host>_<executor_id>' on the first '_', so it cannot name this host")
    return f"executor_{host}_{executor_id}"


def parse_executor_location(location):
    """``(host, executor_id)`` of an :func:`executor_location` string (ValueError if it is not one)."""
    prefix = "executor_"
    if not isinstance(location, str) or not location.startswith(prefix) or "_" not in location[len(prefix):]:
        raise ValueError(f"not an executor location: {location!r}")
    host, executor_id = location[len(prefix):].split("_", 1)
    return host, executor_id


def executor_of(executor_id):
    """The executor a reporter's id names. A Python worker process of Spark executor ``E``
    reports as ``"E.<pid>"`` (an executor runs a worker per task slot, each with its own
    stores); any other id names the executor itself."""
    spark_id, dot, pid = executor_id.rpartition(".")
    return spark_id if dot and spark_id and pid.isdigit() else executor_id


def same_executor(location, host, executor_id):
    """Whether ``location`` (``(host, executor_id)`` of an active instance) is in the executor
    of reporter ``executor_id`` on ``host``: that reporter itself, or another Python worker of
    the same executor (a sibling, whose copy a worker keeps: ``statecore/registry.py``)."""
    return location[0] == host and executor_of(location[1]) == executor_of(executor_id)


class StateStoreCoordinator(rpc.RpcEndpoint):
    """The endpoint: ``instances`` maps provider id (a :class:`ProviderId`, as it arrives:
    checking a report's ids converts none of them) -> ``(host, executor_id)`` of the active instance.

    Parameters
    ----------
    rpc_env : RpcEnv, optional
        The env it is registered in, which ``StopCoordinator`` unregisters it from. Without
        one (the endpoint used as a plain object), ``StopCoordinator`` only logs and replies.
    """

    message_type = CoordinatorMessage

    def __init__(self, rpc_env=None):
        super().__init__()
        self.rpc_env = rpc_env
        self.instances = {}

    def receive(self, message):
        raise ValueError(f"StateStoreCoordinator answers asks only; one-way message {_name(message)} refused")

    def receive_and_reply(self, message):
        match message:
            case ReportActiveInstance():
                return self._report_active_instance(message)
            case VerifyIfInstanceActive():
                location = self.instances.get(_checked(message.provider_id))
                return location is not None and location[1] == message.executor_id  # the host is not compared (Spark)
            case GetLocation():
                location = self.instances.get(_checked(message.provider_id))
                return None if location is None else executor_location(*location)
            case DeactivateInstances():
                return self._deactivate_instances(message.run_id)
            case StopCoordinator():
                return self._stop_coordinator()
        raise ValueError(f"not a StateStoreCoordinator message: {_name(message)}")

    def _report_active_instance(self, message):
        host, executor_id = message.host, message.executor_id
        where = executor_location(host, executor_id)  # refuses what could not be named as a location
        provider_id = _checked(message.provider_id)
        log.debug("Reported state store %s is active at %s", provider_id, where)
        self.instances[provider_id] = (host, executor_id)
        # Ids not registered at all are left alone: only an instance owned by another executor is
        # to be unloaded (one in a sibling worker of the reporter's executor is kept there). Ids
        # that make no provider id are never registered, so they are not found.
        instances = self.instances
        return [p for p in message.provider_ids_to_check
                if (active := instances.get(p)) is not None and not same_executor(active, host, executor_id)]

    def _deactivate_instances(self, run_id):
        stale = [p for p in self.instances if p.query_run_id == run_id]
        for provider_id in stale:
            del self.instances[provider_id]
        log.debug("Deactivated the instances of query run %s: %s", run_id, stale)
        return True

    def _stop_coordinator(self):
        # Unregister before replying, so that the name is free once the caller hears back (Spark).
        if self.rpc_env is not None:
            self.rpc_env.stop_endpoint(ENDPOINT_NAME)
        log.info("StateStoreCoordinator stopped")
        return True


def _checked(provider_id):
    """``provider_id`` (a ProviderId), once its fields are known to make a provider id (ValueError)."""
    provider_id_from_message(provider_id)
    return provider_id


def _name(message):
    """How an error names a message: its class name, or the repr of what is not one."""
    return type(message).__name__ if isinstance(message, rpc.Message) else repr(message)


class StateStoreCoordinatorRef:
    """A typed client of the coordinator; picklable, so it travels to tasks.

    Build it with :meth:`for_driver` (registers the coordinator, or finds the one already
    registered) or :meth:`for_executor` (a client-only ref, for a process with no RpcEnv).
    Every method is a synchronous ask; :class:`~statecore.rpc.RpcError` or
    :class:`~statecore.rpc.RpcTimeoutError` when the coordinator failed or did not answer.
    """

    def __init__(self, endpoint_ref):
        self._ref = endpoint_ref

    @classmethod
    def for_driver(cls, rpc_env):
        """Register the coordinator in ``rpc_env``; if one is registered there already, a ref
        to it, so that every ref of a driver shares one coordinator (Spark's ``forDriver``)."""
        try:
            ref = rpc_env.setup_endpoint(ENDPOINT_NAME, StateStoreCoordinator(rpc_env))
        except EndpointAlreadyRegisteredError:
            ref = rpc_env.endpoint_ref(rpc_env.address, ENDPOINT_NAME, rpc_env.authkey)
        else:
            log.info("Registered StateStoreCoordinator endpoint")
        return cls(ref)

    @classmethod
    def for_executor(cls, address, authkey):
        """A client-only ref to the coordinator of the driver at ``address``."""
        return cls(rpc.endpoint_ref(address, ENDPOINT_NAME, authkey))

    @property
    def address(self):
        return self._ref.address

    @property
    def authkey(self):
        return self._ref.authkey

    def report_active_instance(self, provider_id, host, executor_id, provider_ids_to_check=()):
        """Record this executor as the owner of ``provider_id``; returns those of
        ``provider_ids_to_check`` that are active on another executor (to unload here; not
        those in another Python worker of the same executor: :func:`same_executor`). More than
        REPORT_IDS_PER_MESSAGE ids go in several reports of this provider id, one after another.

        Raises ``ValueError`` for a host with ``_`` in it (see :func:`executor_location`).
        """
        executor_location(host, executor_id)
        reported = provider_id_to_message(provider_id)
        to_check = [provider_id_to_message(p) for p in provider_ids_to_check]
        active_elsewhere = []
        for start in range(0, max(len(to_check), 1), REPORT_IDS_PER_MESSAGE):
            message = ReportActiveInstance(reported, host, executor_id, to_check[start:start + REPORT_IDS_PER_MESSAGE])
            active_elsewhere += self._ref.ask(message, reply_type=_PROVIDER_IDS)
        return [provider_id_from_message(p) for p in active_elsewhere]

    def verify_if_instance_active(self, provider_id, executor_id):
        """Whether ``executor_id`` holds the active instance of ``provider_id``."""
        if not isinstance(executor_id, str):
            raise TypeError(f"executor_id must be str, got {type(executor_id).__name__}")
        return self._ref.ask(VerifyIfInstanceActive(provider_id_to_message(provider_id), executor_id),
                             reply_type=bool)

    def get_location(self, provider_id):
        """``"executor_<host>_<executor_id>"`` of the active instance, or None."""
        return self._ref.ask(GetLocation(provider_id_to_message(provider_id)), reply_type=_LOCATION)

    def deactivate_instances(self, run_id):
        """Forget every instance of the query run ``run_id`` (a ``uuid.UUID``); returns True."""
        if not isinstance(run_id, uuid.UUID):
            raise TypeError(f"run_id must be a uuid.UUID, got {type(run_id).__name__}")
        return self._ref.ask(DeactivateInstances(run_id), reply_type=bool)

    def stop(self):
        """Stop the coordinator: its name is unregistered by the time this returns."""
        return self._ref.ask(StopCoordinator(), reply_type=bool)

    def __repr__(self):
        return f"StateStoreCoordinatorRef({self.address!r})"
