"""Networking shared by every OpenTinker process: TLS (:mod:`.tls`), API keys on calls
(:mod:`.bearer`), the side ports' scrape token (:mod:`.side_port`) and bounded HTTP server
(:mod:`.bounded_http`), gRPC options (:mod:`.grpc_options`),
scheduler URLs (:mod:`.url`) and transport errors (:mod:`.transport`)."""
