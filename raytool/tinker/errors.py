"""What the Tinker service refuses, as the HTTP status the `tinker` client turns into its own error
types: 400 (BadRequestError: a bad loss, datum or argument, a call not served), 404
(NotFoundError: an unknown or released session, model, sampler or checkpoint), 401 (a wrong key)."""

from __future__ import annotations


class Refused(Exception):
    status = 400


class Unknown(Refused):
    status = 404


class Unauthorized(Refused):
    status = 401
