#!/bin/sh
# The unprivileged user (uid/gid 1000) the containers run as; reuses an existing uid 1000 (e.g. Ubuntu's).
set -eu
if ! getent group 1000 >/dev/null; then echo "app:x:1000:" >> /etc/group; fi
if ! getent passwd 1000 >/dev/null; then echo "app:x:1000:1000:app:/home/app:/usr/sbin/nologin" >> /etc/passwd; fi
mkdir -p /home/app/.cache /app
chown -R 1000:1000 /home/app
