"""One router per resource; `api.app` mounts them all."""
