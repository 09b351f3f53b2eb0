"""rollflow's HTTP toolkit, shared by the engine server, the router and the TITO proxy.

- ``front``: ``HttpFront``, a small HTTP/1.1 server for a listener's hot requests (aiohttp serves the rest);
- ``upstream``: ``UpstreamPool``, a lean kept-alive HTTP/1.1 client the router forwards with;
- ``limits``: ``HttpLimits``, what a listener tolerates from slow clients (no aiohttp, for the command line);
- ``runner``: ``JSONErrorAppRunner``, aiohttp's runner with those limits and JSON errors from its protocol layer;
- ``errors``: the JSON error of every listener, as aiohttp responses and as raw bytes;
- ``auth``: the bearer-token check, and the warning for a listener open beyond loopback without one;
- ``sse``: server-sent events, written and read.

Nothing here imports torch, and this package imports none of its modules: import the one you need.
"""
