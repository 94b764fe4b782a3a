"""Engine-agnostic KV-event wire protocol and ZMQ transport."""
