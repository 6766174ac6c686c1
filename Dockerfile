# meshgate's container image: the `meshgate` CLI (webhook, controller) and `meshgate-wait` (the
# init-container gate), both linked statically, on an empty base image.
#
#   docker build -t meshgate/meshgate:0.1.0 .
#
# The development machines of this project have no container engine, so this file is not built
# in CI; CI tests the binaries themselves (see README.md). The static link uses glibc's static
# libraries (`-C target-feature=+crt-static` on the gnu target); meshgate-wait does no DNS and
# loads nothing dynamically.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
ENV RUSTFLAGS="-C target-feature=+crt-static"
RUN cargo build --release --locked --target x86_64-unknown-linux-gnu -p meshgate -p meshgate-wait \
 && mkdir /out \
 && cp target/x86_64-unknown-linux-gnu/release/meshgate target/x86_64-unknown-linux-gnu/release/meshgate-wait /out/

FROM scratch
COPY --from=build /out/meshgate /meshgate
COPY --from=build /out/meshgate-wait /meshgate-wait
USER 65532:65532
ENTRYPOINT ["/meshgate"]
