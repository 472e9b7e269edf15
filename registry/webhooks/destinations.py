"""Where webhooks may POST: public addresses only, unless the operator's allow-list admits an internal receiver.

A URL is checked when a webhook is created and again before every delivery attempt. Its host is resolved
once, every address it resolves to is checked, and the attempt connects to a checked address (the name
goes only into the Host header and the TLS server name): a name cannot pass the check with a public
address and then be resolved again to a private one for the connection.

Refused unless the allow-list (`KILN_REGISTRY_WEBHOOK_ALLOW`) admits them: loopback, private, link-local,
shared (CGNAT), reserved and documentation addresses, and IPv6 addresses that embed one (IPv4-mapped,
-compatible, 6to4, Teredo, NAT64). Refused always: unspecified (0.0.0.0, ::), multicast and the cloud
metadata services. An allow-list entry is a network (`10.0.0.0/8`, `127.0.0.1`, `fd00::/8`) whose
addresses it admits, or a `host:port` (`hooks.internal:8443`, `127.0.0.1:9000`, `[::1]:9000`) that it
admits on that port whatever its addresses.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.registry.ops.logs import redact_urls
from kiln.registry.settings import HOST_LABEL, AllowList, IPAddress, RegistrySettings

# host, port -> the addresses it resolves to; raises DestinationUnresolvable when it resolves to none.
Resolver = Callable[[str, int], Sequence[IPAddress]]

MAX_URL_LENGTH = 2048
DEFAULT_PORTS = {"http": 80, "https": 443}
# Never a receiver, whatever the allow-list says: they answer with cloud credentials (AWS, GCP, Azure,
# OpenStack at 169.254.169.254; AWS over IPv6; Alibaba; Azure's wire server), or cannot be connected to.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16")
)
# IPv6 prefixes whose last 32 bits are an IPv4 address a packet ends up at (NAT64, IPv4-compatible).
_IPV4_SUFFIX_PREFIXES = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")
# WHATWG URL: a host whose last label is a number is an IPv4 address in one of its legacy forms
# (2130706433, 0x7f000001, 0177.0.0.1, 127.1), which resolvers accept too.
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")


class DestinationForbidden(InvalidInput):
    """A webhook URL whose host is (or resolves to) an address webhooks may not reach."""

    code = Codes.WEBHOOK_DESTINATION_FORBIDDEN


class DestinationUnresolvable(InvalidInput):
    """A webhook URL whose host name resolves to no address."""

    code = Codes.WEBHOOK_DESTINATION_UNRESOLVABLE


def _invalid(url: str, problem: str) -> InvalidInput:
    # The URL as logs show it: a password or a query may be in it.
    return InvalidInput(
        f"webhook URL {redact_urls(url[:200])!r} is not valid: {problem}", code=Codes.INVALID_WEBHOOK_URL
    )


@dataclass(frozen=True)
class WebhookUrl:
    """A webhook URL taken apart: its host is a lowercase name (no trailing dot) or an address, in
    whichever form the URL wrote it (`address` is that address)."""

    scheme: str
    host: str
    address: IPAddress | None  # the host, when it is an address in any of its forms
    port: int
    target: str  # path and query, as sent in the request line

    @property
    def host_header(self) -> str:
        """The Host header: the host as named, with the port unless it is the scheme's default."""
        host = self.host if self.address is None else _literal(self.address)
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    def url_to(self, address: IPAddress) -> str:
        """The URL of this request sent straight to `address`."""
        return f"{self.scheme}://{_literal(address)}:{self.port}{self.target}"


def _literal(address: IPAddress) -> str:
    return f"[{address}]" if isinstance(address, ipaddress.IPv6Address) else str(address)


def parse_url(url: str) -> WebhookUrl:
    """InvalidInput (INVALID_WEBHOOK_URL) unless `url` is an absolute http(s) URL with a host name or
    address, and no user name or password (signatures authenticate kiln to receivers)."""
    if len(url) > MAX_URL_LENGTH or any(c.isspace() or not c.isprintable() for c in url):
        raise _invalid(url, f"it must be at most {MAX_URL_LENGTH} printable characters without spaces")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _invalid(url, str(exc)) from None
    if parts.scheme not in DEFAULT_PORTS:
        raise _invalid(url, "the scheme must be http or https")
    if not parts.hostname:
        raise _invalid(url, "it has no host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise _invalid(url, "a user name or password in the URL is not accepted; receivers verify the signature")
    # A name's trailing dot (the root) is not part of it: `localhost.` is `localhost`.
    host = parts.hostname.removesuffix(".")
    address = _address_of(url, host, bracketed=parts.netloc.startswith("["))
    if address is None and not (host.isascii() and all(HOST_LABEL.fullmatch(label) for label in host.split("."))):
        raise _invalid(url, f"host {host!r} is neither an IP address nor a host name (IDNs in their xn-- form)")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return WebhookUrl(parts.scheme, host, address, port or DEFAULT_PORTS[parts.scheme], target)


def _address_of(url: str, host: str, *, bracketed: bool) -> IPAddress | None:
    """The address a URL's host names, if it names one; None for a host name."""
    if bracketed:
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            address = None
        if address is None or address.scope_id:
            raise _invalid(url, f"[{host}] is not an IPv6 address (zone ids are not accepted)")
        return address
    if not host or not _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        raise _invalid(url, f"{host!r} is not an IPv4 address") from None


def system_resolver(host: str, port: int) -> list[IPAddress]:
    """The addresses `host` resolves to (the system's resolver, /etc/hosts included), in its order."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise DestinationUnresolvable(
            f"webhook host {host!r} does not resolve", details={"host": host, "reason": type(exc).__name__}
        ) from None
    addresses: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
            if address not in addresses:
                addresses.append(address)
    return addresses


def _embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries, which a packet to it may reach."""
    if isinstance(address, ipaddress.IPv4Address):
        return []
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    if address in _IPV4_COMPATIBLE or any(address in prefix for prefix in _IPV4_SUFFIX_PREFIXES):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def _never(address: IPAddress) -> str | None:
    if address in METADATA_ADDRESSES:
        return "cloud metadata"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    return None


def _not_public(address: IPAddress) -> str | None:
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local"
    if address.is_private:
        return "private"
    if address in _SHARED:
        return "shared (CGNAT)"
    if address.is_reserved or not address.is_global:
        return "reserved"
    return None


def refusal(address: IPAddress, port: int, allow: AllowList, *, admitted: bool = False) -> str | None:
    """Why a webhook may not connect to `address` on `port` (a kind of address), or None if it may.
    `admitted`: the operator admitted the URL's host name on this port, wherever it points."""
    candidates = (address, *_embedded_ipv4(address))
    for candidate in candidates:
        never = _never(candidate)
        if never is not None:
            return never
    if admitted or allow.admits(address, port):
        return None
    for candidate in reversed(candidates):  # the IPv4 address a packet would reach says most
        reason = _not_public(candidate)
        if reason is not None:
            return reason if candidate is address else f"{reason}, embedded IPv4"
    return None


@dataclass(frozen=True)
class Destination:
    """A checked webhook URL and the addresses an attempt may connect to, in the order to try them."""

    url: WebhookUrl
    addresses: tuple[IPAddress, ...]


class DestinationPolicy:
    """Checks webhook URLs: public destinations, or ones the allow-list admits; resolves each name once."""

    def __init__(self, allow: AllowList | None = None, resolver: Resolver = system_resolver) -> None:
        self.allow = allow or AllowList()
        self._resolve = resolver

    @classmethod
    def from_settings(cls, settings: RegistrySettings, resolver: Resolver | None = None) -> DestinationPolicy:
        """The policy of `settings.webhook_allow`, resolving with `resolver` (default: the system's)."""
        return cls(AllowList.parse(settings.webhook_allow), resolver or system_resolver)

    def check(self, url: str) -> Destination:
        """The destination `url` names, with its checked addresses. Raises InvalidInput
        (INVALID_WEBHOOK_URL), DestinationUnresolvable or DestinationForbidden."""
        parsed = parse_url(url)
        if parsed.address is not None:
            addresses: Sequence[IPAddress] = [parsed.address]
        else:
            addresses = self._resolve(parsed.host, parsed.port)
            if not addresses:
                raise DestinationUnresolvable(
                    f"webhook host {parsed.host!r} does not resolve", details={"host": parsed.host}
                )
        admitted = parsed.address is None and self.allow.admits_endpoint(parsed.host, parsed.port)
        for address in addresses:
            reason = refusal(address, parsed.port, self.allow, admitted=admitted)
            if reason is not None:
                raise DestinationForbidden(
                    f"webhooks may not be sent to {parsed.host!r}: it is or resolves to an address they may not reach "
                    f"({reason}); an operator admits internal receivers with KILN_REGISTRY_WEBHOOK_ALLOW",
                    details={"host": parsed.host, "reason": reason},
                )
        return Destination(parsed, tuple(addresses))
