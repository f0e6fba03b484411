"""The driver's StateStoreCoordinator and its typed client, StateStoreCoordinatorRef (spec section 7).

The coordinator records which executor holds the *active* instance of each state store
provider, keyed by :class:`~statecore.StateStoreProviderId`. Executors report every load
(``ReportActiveInstance``) and ask during maintenance whether their instance is still the
active one (``VerifyIfInstanceActive``); the driver asks where a store is loaded
(``GetLocation``, for preferred locations) and forgets a query's instances when it stops
(``DeactivateInstances``).

Every message is request/reply, as in Spark since 3.2. Messages are tuples of RPC values,
the message name first; a provider id travels as the tuple of
:func:`provider_id_to_message`, the one place that conversion is defined.

Thread-safety: the endpoint is driven by :mod:`statecore.rpc`, which hands it one message at
a time, so it keeps no lock; do not call its handlers from several threads yourself. A
:class:`StateStoreCoordinatorRef` may be shared by threads and pickled into tasks.
"""
import logging
import uuid

from statecore import rpc
from statecore.ids import StateStoreId, StateStoreProviderId

__all__ = ["ENDPOINT_NAME", "StateStoreCoordinator", "StateStoreCoordinatorRef", "executor_location", "lookup_handler",
           "provider_id_from_message", "provider_id_to_message"]

log = logging.getLogger(__name__)

ENDPOINT_NAME = "StateStoreCoordinator"


def provider_id_to_message(provider_id):
    """A provider id as an RPC value: ``(checkpoint_root_location, operator_id, partition_id,
    store_name, str(query_run_id))``."""
    if not isinstance(provider_id, StateStoreProviderId):
        raise TypeError(f"expected a StateStoreProviderId, got {type(provider_id).__name__}")
    store_id = provider_id.store_id
    return (store_id.checkpoint_root_location, store_id.operator_id, store_id.partition_id,
            store_id.store_name, str(provider_id.query_run_id))


def provider_id_from_message(value):
    """The provider id of a :func:`provider_id_to_message` tuple (a list is accepted too)."""
    if not isinstance(value, (tuple, list)) or len(value) != 5:
        raise ValueError(f"a provider id is a 5-tuple (root, operator, partition, store name, run id), got {value!r}")
    root, operator_id, partition_id, store_name, run_id = value
    return StateStoreProviderId(StateStoreId(root, operator_id, partition_id, store_name), uuid.UUID(run_id))


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


class StateStoreCoordinator(rpc.RpcEndpoint):
    """The endpoint: ``instances`` maps provider id -> ``(host, executor_id)`` of the active instance.

    Parameters
    ----------
    rpc_env : RpcEnv, optional
        The env it is registered in, which ``StopCoordinator`` unregisters it from. Without
        one (the endpoint used as a plain object), ``StopCoordinator`` only logs and replies.
    """

    def __init__(self, rpc_env=None):
        super().__init__()
        self.rpc_env = rpc_env
        self.instances = {}

    def receive(self, message):
        raise ValueError(f"StateStoreCoordinator answers asks only; one-way message {_name(message)!r} refused")

    def receive_and_reply(self, message):
        handler = lookup_handler(self._handlers, "StateStoreCoordinator", message)
        return handler(self, *message[1:])

    def _report_active_instance(self, provider_id, host, executor_id, provider_ids_to_check):
        where = executor_location(host, executor_id)  # refuses what could not be named as a location
        provider_id = provider_id_from_message(provider_id)
        location = (host, executor_id)
        log.debug("Reported state store %s is active at %s", provider_id, where)
        self.instances[provider_id] = location
        to_check = (provider_id_from_message(p) for p in provider_ids_to_check)
        # Ids not registered at all are left alone (spec 7.3): only another owner unloads.
        return [provider_id_to_message(p) for p in to_check if self.instances.get(p, location) != location]

    def _verify_if_instance_active(self, provider_id, executor_id):
        location = self.instances.get(provider_id_from_message(provider_id))
        return location is not None and location[1] == executor_id  # the host is not compared (Spark)

    def _get_location(self, provider_id):
        location = self.instances.get(provider_id_from_message(provider_id))
        return None if location is None else executor_location(*location)

    def _deactivate_instances(self, run_id):
        run_id = uuid.UUID(run_id)
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

    _handlers = {  # message name -> (handler, number of arguments after the name)
        "ReportActiveInstance": (_report_active_instance, 4),
        "VerifyIfInstanceActive": (_verify_if_instance_active, 2),
        "GetLocation": (_get_location, 1),
        "DeactivateInstances": (_deactivate_instances, 1),
        "StopCoordinator": (_stop_coordinator, 0),
    }


def _name(message):
    if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
        raise ValueError(f"a message is a tuple whose first item is its name, got {message!r}")
    return message[0]


def lookup_handler(handlers, endpoint, message):
    """The handler of ``message`` from ``handlers`` (name -> (handler, arity)); ValueError for
    an unknown name or a wrong number of arguments. Shared with :mod:`statecore.epoch`."""
    name = _name(message)
    if name not in handlers:
        raise ValueError(f"unknown {endpoint} message {name!r}")
    handler, arity = handlers[name]
    if len(message) - 1 != arity:
        raise ValueError(f"{endpoint} message {name!r} takes {arity} arguments, got {len(message) - 1}")
    return handler


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
        except ValueError as e:
            if "already registered" not in str(e):
                raise
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
        ``provider_ids_to_check`` that are active on another executor (to unload here).

        Raises ``ValueError`` for a host with ``_`` in it (see :func:`executor_location`).
        """
        executor_location(host, executor_id)
        reply = self._ref.ask(("ReportActiveInstance", provider_id_to_message(provider_id), host, executor_id,
                               [provider_id_to_message(p) for p in provider_ids_to_check]))
        return [provider_id_from_message(p) for p in reply]

    def verify_if_instance_active(self, provider_id, executor_id):
        """Whether ``executor_id`` holds the active instance of ``provider_id``."""
        return self._ref.ask(("VerifyIfInstanceActive", provider_id_to_message(provider_id), executor_id))

    def get_location(self, provider_id):
        """``"executor_<host>_<executor_id>"`` of the active instance, or None."""
        return self._ref.ask(("GetLocation", provider_id_to_message(provider_id)))

    def deactivate_instances(self, run_id):
        """Forget every instance of the query run ``run_id`` (a ``uuid.UUID``); returns True."""
        if not isinstance(run_id, uuid.UUID):
            raise TypeError(f"run_id must be a uuid.UUID, got {type(run_id).__name__}")
        return self._ref.ask(("DeactivateInstances", str(run_id)))

    def stop(self):
        """Stop the coordinator: its name is unregistered by the time this returns."""
        return self._ref.ask(("StopCoordinator",))

    def __repr__(self):
        return f"StateStoreCoordinatorRef({self.address!r})"
