#!/usr/bin/env bash
# Makes a throwaway CA and a server and a client certificate signed by it,
# for TLS / mutual-TLS tests on 127.0.0.1. Usage: make_test_certs.sh DIR
# Writes DIR/{ca,server,client}.{crt,key}; valid 2 days; never for production.
# The server certificate also allows clientAuth, as the chart's node secret must
# (the router and the nodes' TLS probe present it as a client).
set -euo pipefail
dir=$1
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -subj "/CN=colibri-test-ca" -days 2 2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -keyout "$who.key" -out "$who.csr" -subj "/CN=colibri-test-$who" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=%s\n' \
    "$([ "$who" = server ] && echo serverAuth,clientAuth || echo clientAuth)" > "$who.ext"
  openssl x509 -req -in "$who.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$who.crt" -days 2 \
    -extfile "$who.ext" 2>/dev/null
  rm -f "$who.csr" "$who.ext"
done
echo "test certificates in $dir"
