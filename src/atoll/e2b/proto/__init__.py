"""envd's services as generated Python (scripts/gen_e2b_stubs.py; never edit the generated files):
`process.process_pb` / `process.process_connect` and `filesystem.filesystem_pb` /
`filesystem.filesystem_connect`. Imported by the E2B edge."""
