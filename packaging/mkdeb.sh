#!/bin/sh
# packaging/mkdeb.sh ROOT VERSION OUT: turn the tree that
#   make install DESTDIR=ROOT PREFIX=/usr LIBDIR=/usr/lib/<multiarch>
# produced into the Debian package OUT, with dpkg-deb (no debhelper, no
# rebuild: `make deb` packages exactly what `make` built). Adds what Debian
# policy asks of a binary package: compressed man pages, a copyright file,
# the conffiles list, maintainer scripts that run systemd-sysusers and
# systemd-tmpfiles, and Depends: computed from the binaries' libraries.
set -eu
root=$1 version=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
arch=$(dpkg --print-architecture)

find "$root/usr/share/man" -type f -name '*.[0-9]' -exec gzip -9nf {} +
install -D -m 0644 "$here/debian/copyright" "$root/usr/share/doc/moed/copyright"

# The packages holding the shared libraries the binaries need directly
# (DT_NEEDED, as dpkg-shlibdeps counts them). ldd prints /lib paths that
# dpkg may know under /usr/lib (merged /usr), or the other way round, so
# each is asked for in every spelling, all in one dpkg -S.
libs() {
    for need in $(readelf -d "$1" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'); do
        ldd "$1" | awk -v n="$need" '$1 == n && $3 ~ /^\// { print $3 }'
    done
}
bins=$(find "$root" -type f \( -path '*/sbin/*' -o -path '*/bin/*' -o -name 'lib*.so*' \))
paths=$(for f in $bins; do libs "$f"; done | sort -u | while read -r l; do
            r=$(readlink -f "$l")
            printf '%s\n' "$l" "$r" "${l#/usr}" "/usr${l#/usr}" "${r#/usr}" "/usr${r#/usr}"
        done | sort -u)
deps=$(dpkg -S $paths 2>/dev/null | cut -d: -f1 | sort -u | paste -sd, - | sed 's/,/, /g')
[ -n "$deps" ] || deps=libc6

mkdir -p "$root/DEBIAN"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@SIZE@|$size|" \
    -e "s|@DEPENDS@|$deps|" "$here/debian/control.in" > "$root/DEBIAN/control"
(cd "$root" && find etc -type f 2>/dev/null | sed 's|^|/|' | sort) > "$root/DEBIAN/conffiles"
[ -s "$root/DEBIAN/conffiles" ] || rm -f "$root/DEBIAN/conffiles"
for s in postinst prerm postrm; do
    install -m 0755 "$here/debian/$s" "$root/DEBIAN/$s"
done
dpkg-deb --root-owner-group -Zxz -z2 --build "$root" "$out" >/dev/null
echo "built $out (Depends: $deps)"
