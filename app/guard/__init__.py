"""app.guard: what stands between a client and the collection, on every route of the server. One access rule, the
login or the token, with failed logins counted once for every door (:mod:`~app.guard.access`); the names the server
answers to and the other sites' pages it lets read it (:mod:`~app.guard.origins`); what one client's connections may
cost (:mod:`~app.guard.connections`) and what the log may be made to hold (:mod:`~app.guard.log_limits`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "ApiSettings": "access", "AccessMiddleware": "access", "LoginThrottle": "access",
    "HostGuardMiddleware": "origins", "ConnectionLimits": "connections", "LogLimits": "log_limits",
})
