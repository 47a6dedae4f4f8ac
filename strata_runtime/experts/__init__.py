"""Where routed experts live and how they are chosen: the VRAM expert cache over a host tier, and the
calibrated routing model of synthetic presets."""
