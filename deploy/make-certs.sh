#!/usr/bin/env bash
# Generate the deployment's TLS and SuperNode-authentication material (for demos and tests only).
#
#   deploy/make-certs.sh [OUT_DIR] [NUM_SUPERNODES]     (defaults: deploy/certs, 2)
#
# Writes into OUT_DIR (gitignored under deploy/certs/; never commit it):
#   ca.crt, ca.key            a self-signed CA (RSA 4096, 365 days)
#   server.pem, server.key    the SuperLink's certificate, signed by the CA, with
#                             SAN DNS:superlink, DNS:localhost, IP:127.0.0.1 (and IP:::1)
#   supernode-<i>, supernode-<i>.pub   (i = 1..N) ECDSA P-384 key pairs in OpenSSH format,
#                             the form `flower-supernode --auth-supernode-private-key` and
#                             `flwr supernode register` read
# Existing files in OUT_DIR are replaced. Private keys are created mode 600.
set -euo pipefail

OUT=${1:-"$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/certs"}
NODES=${2:-2}
DAYS=${CERT_DAYS:-365}
command -v openssl >/dev/null || { echo "make-certs.sh: openssl is required" >&2; exit 1; }
case $NODES in ''|*[!0-9]*) echo "make-certs.sh: NUM_SUPERNODES must be a number, got '$NODES'" >&2; exit 2;; esac

mkdir -p "$OUT"
umask 077
cd "$OUT"
rm -f ca.crt ca.key ca.srl server.pem server.key server.csr server.ext supernode-*

# Certificate authority
openssl req -x509 -newkey rsa:4096 -sha256 -nodes -days "$DAYS" \
  -keyout ca.key -out ca.crt -subj "/CN=fedsim deployment demo CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# SuperLink server certificate
openssl req -newkey rsa:4096 -sha256 -nodes -keyout server.key -out server.csr -subj "/CN=superlink" 2>/dev/null
cat > server.ext <<EXT
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:superlink,DNS:localhost,IP:127.0.0.1,IP:::1
EXT
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days "$DAYS" \
  -extfile server.ext -out server.pem 2>/dev/null
rm -f server.csr server.ext ca.srl

# SuperNode authentication key pairs (OpenSSH format, ECDSA P-384)
for i in $(seq 1 "$NODES"); do
  if command -v ssh-keygen >/dev/null; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "supernode-$i"
  else  # same format through Python's cryptography (shipped with flwr)
    ${PYTHON:-python3} - "supernode-$i" <<'PY'
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
key = ec.generate_private_key(ec.SECP384R1())
name = sys.argv[1]
open(name, "wb").write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                         serialization.NoEncryption()))
open(name + ".pub", "wb").write(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                              serialization.PublicFormat.OpenSSH) + b"\n")
PY
  fi
done

chmod 600 ca.key server.key supernode-*[0-9]
# Readable by the containers' non-root user (flwr images run as `app`); still never commit these.
chmod 644 ca.crt server.pem supernode-*.pub
echo "wrote CA, SuperLink certificate and $NODES SuperNode key pairs to $OUT"
