"""Where a webhook may point: a URL checked when it is registered and its host's addresses
checked again each time it is posted to.

A tenant names the URL, the operator's machine makes the request: without a check, a
webhook is a way to make the server call into its own network (server-side request
forgery: a cloud's metadata service at 169.254.169.254, a database on localhost). So a
target must be https (http only if the operator allows it), carry no credentials, and
resolve to public addresses only: loopback, private, link-local, shared, reserved and
multicast addresses are refused unless the operator allows them. A name is resolved and
every address it has is checked, which also catches spellings such as ``2130706433`` or
``0x7f.1``. The sender connects to an address it checked itself (broker/webhooks.py), so a
name that resolves elsewhere by the time of the post (DNS rebinding) is refused then.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL = 2000


class TargetError(ValueError):
    """A webhook URL that is refused; the message says why."""


@dataclass(frozen=True)
class Target:
    scheme: str  # http | https
    host: str  # as written (the Host header, the TLS server name)
    port: int
    path: str  # path and query, at least "/"


def parse_target(url: str, *, allow_http: bool = False) -> Target:
    """The URL's parts; TargetError if it is no URL a webhook may have (resolving aside)."""
    if not isinstance(url, str) or not url.strip():
        raise TargetError("url: empty")
    if len(url) > MAX_URL:
        raise TargetError(f"url: longer than {MAX_URL} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise TargetError("url: contains spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetError(f"url: not a URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise TargetError(f"url: scheme must be https, not {scheme or 'none'!r}")
    if scheme == "http" and not allow_http:
        raise TargetError("url: must be https:// (plain http only where the operator sets "
                          "SPECQ_WEBHOOK_ALLOW_HTTP)")
    if parts.username is not None or parts.password is not None:
        raise TargetError("url: must not carry a user or password")
    if not parts.hostname:
        raise TargetError("url: no host")
    if parts.fragment:
        raise TargetError("url: must not have a #fragment")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(scheme, parts.hostname, port or (443 if scheme == "https" else 80), path)


# IPv6 forms that carry an IPv4 address a network may reach: NAT64's well-known prefix
# (RFC 6052), SIIT's IPv4-translated addresses (::ffff:0:a.b.c.d, RFC 2765) and
# IPv4-compatible ones (::a.b.c.d, deprecated); 6to4 and mapped ones ipaddress reads
# itself. NAT64's local-use prefix (RFC 8215) is a site's own.
NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
CARRYING = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))


def is_public(address: str) -> bool:
    """Whether an IP address is a public one: an IPv6 address that carries an IPv4 one
    (mapped, NAT64, 6to4, IPv4-compatible) is judged by the IPv4 address it carries."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(
        address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in NAT64_LOCAL:
            return False
        carried = ip.ipv4_mapped or ip.sixtofour
        if carried is None and any(ip in net for net in CARRYING):
            carried = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if carried is not None:
            ip = carried
    return ip.is_global and not ip.is_multicast


def resolve(target: Target, *, allow_private: bool = False) -> list[str]:
    """The addresses of the target's host (resolved now), every one checked; TargetError
    if it does not resolve or any address is not public (unless ``allow_private``)."""
    try:
        found = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetError(f"url: host {target.host!r} does not resolve ({exc})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    if not allow_private:
        private = [a for a in addresses if not is_public(a)]
        if private:
            raise TargetError(
                f"url: host {target.host!r} is a loopback, private or otherwise non-public "
                f"address ({', '.join(private[:3])}); refused unless the operator sets "
                "SPECQ_WEBHOOK_ALLOW_PRIVATE")
    if not addresses:
        raise TargetError(f"url: host {target.host!r} has no address")
    return addresses


def check_url(url: str, *, allow_private: bool = False, allow_http: bool = False) -> Target:
    """parse_target and resolve: a URL a webhook may be registered with."""
    target = parse_target(url, allow_http=allow_http)
    resolve(target, allow_private=allow_private)
    return target
