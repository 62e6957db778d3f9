"""The gateway's live web dashboard (``/dashboard``, issue 27): ``api_router`` serves it, ``data`` reads what it shows."""
