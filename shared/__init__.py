"""Pure building blocks shared by the pleach client and server: no I/O here."""
