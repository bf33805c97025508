"""Networking shared by every OpenTinker process: TLS (:mod:`.tls`), API keys on calls
(:mod:`.bearer`), the HTTP side port (:mod:`.side_port`), gRPC options (:mod:`.grpc_options`),
scheduler URLs (:mod:`.url`) and transport errors (:mod:`.transport`)."""
