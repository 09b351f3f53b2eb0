"""Plain helpers shared by test modules (builders, stand-ins, checks, background servers); fixtures live in
conftest.py, which imports the two defined here (``tito.tiny_chat``, ``ray_cluster.ray_cluster``). Test
modules import from here, never from each other."""
