"""The Tinker API (Thinking Machines' `tinker` client, and the tinker-cookbook's loops written
against it) served by raytool's trainer and rollout engine: `raytool serve --tinker`. The service
logic is raytool.tinker.service, its HTTP routes raytool.tinker.server, its protobuf bodies
raytool.tinker.wire. Needs the `tinker` extra (the client package's schema)."""
