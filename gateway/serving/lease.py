"""A reservation's one owner: whoever holds the Lease releases the load, and only it.

A request's load is reserved when it is decided (Proxy.reserve_first, in the decision's own step
of the event loop) and then passes from hand to hand: the handler holds it while flow control
may still drop the request, the proxy takes it for the try on its replica, a streamed answer's
response takes it until its last byte. Each step takes it with `hand_over()`, which leaves the
giver empty, so at any moment exactly one Lease holds the reservation and a giver's own `with`
or `release()` lets go of nothing once it has given it away.

`release()` is synchronous (no await for a cancellation to land on) and the Lease forgets the
reservation as it releases it, so every exit (an answer's end, an error, a retry onto the next
replica, a client gone, a cancelled task) releases it exactly once.
"""

from __future__ import annotations

from gateway.fleet.replica import Replica, Reservation


class Lease:
    __slots__ = ("_reservation",)

    def __init__(self, reservation: Reservation | None = None) -> None:
        self._reservation = reservation

    @property
    def reservation(self) -> Reservation:
        """What this lease holds; a lease handed over or released holds nothing to read."""
        if self._reservation is None:
            raise RuntimeError("this lease was handed over or released")
        return self._reservation

    @property
    def held(self) -> bool:
        return self._reservation is not None

    def holds(self, replica: Replica) -> bool:
        """True while this lease holds a reservation on `replica`."""
        return self._reservation is not None and self._reservation.replica is replica

    def hand_over(self) -> Lease:
        """A new lease that now owns the reservation; this one is left empty."""
        taken, self._reservation = self._reservation, None
        return Lease(taken)

    def release(self) -> None:
        """Give the load back, if this lease still holds it (a no-op once handed over)."""
        released, self._reservation = self._reservation, None
        if released is not None:
            released.release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.release()
