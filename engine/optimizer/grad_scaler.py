"""Dynamic loss scaling for fp16: keep small gradients representable without overflowing.

The loss is multiplied by `scale` before backward and the gradients divided by it before the
step. A step whose gradients hold inf/nan is skipped; after `hysteresis` such steps the scale is
halved (never below `min_scale`). After `growth_interval` clean steps in a row it doubles.
Megatron-Core's DynamicGradScaler semantics.
"""

from __future__ import annotations


class DynamicGradScaler:
    def __init__(
        self,
        initial_scale: float,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        if not (initial_scale > 0 and min_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError("loss scaler: scales must be > 0, growth_factor > 1 and 0 < backoff_factor < 1")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
