"""Whom the user's credentials go to, and where a remote index may send the fetcher.

An index is often somebody else's file: a CSV on a web server, a meta file whose
URL prefix points anywhere. What it names must not decide where the user's
credentials go, nor which machines the trainer talks to. So a :class:`Scope`,
made once from what the *user* named (:func:`scope_for`), rules every request:

- **Credentials** (``headers=``) go only to the origins (scheme, host, port) the
  user named: the origin of each http(s) index the user gave, and those listed in
  ``credential_origins=``. A local index names no origin of its own, so with one
  the origins must be listed; headers that would reach no origin are an error
  where they are given, not a silent no-op. A redirect to another origin drops
  them (the Fetcher decides per hop).
- **Targets**: a *remote* index (one read from a server or a store) may send the
  fetcher to its own origin and to public addresses. A host that is, or resolves
  to, a loopback, link-local (169.254.169.254, the cloud metadata service),
  private (10/8, 172.16/12, 192.168/16, fc00::/7) or otherwise non-public address
  is refused unless ``allow_networks=`` covers it, so an index cannot point the
  trainer at the services of its own network. Names are checked at the addresses
  they resolve to, for every connection and every redirect (a name that resolves
  to a private address is refused, not only a literal one). A local index is the
  user's own file: what it names is fetched as named (but a list joining it with a
  remote index is guarded whole: one Scope serves the list's fetches).
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..options import check_networks, check_origins, origin_of, spell_origin

__all__ = [
    "Scope",
    "TargetRefused",
    "address_kind",
    "locations_of",
    "origins_in",
    "resolver",
    "scope_for",
]

Origin = tuple[str, str, int]  # (scheme, host, port), the port spelled out

_DEFAULT_PORT = {"http": 80, "https": 443}


def _parse_spelled(origin: str) -> Origin:
    o = origin_of(origin)
    assert o is not None, origin
    return o


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What makes `ip` not a public address ("loopback", "link-local"...), None if public.

    An IPv4 address written as IPv6 (``::ffff:127.0.0.1``) is judged as the IPv4 one.
    """
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "non-public"
    return None


class TargetRefused(OSError):
    """A host a remote index named that is, or resolves to, an address it may not reach."""


@dataclass(frozen=True)
class Scope:
    """Where credentials go and which targets are refused; see the module docstring.

    ``credentials``: the origins (spelled ``scheme://host:port``) that get the
    headers; None: the origin of every URL asked for (a bare :class:`Fetcher`,
    whose caller names each URL). ``guard``: targets are checked (the index is
    remote, ``index`` names it, for messages); ``trusted``: ``host:port`` pairs
    the user named, reached whatever their address; ``networks``: non-public
    networks allowed all the same.
    """

    credentials: frozenset[str] | None = None
    guard: bool = False
    index: str = ""
    trusted: frozenset[str] = frozenset()
    networks: tuple[str, ...] = ()
    _nets: tuple = field(default=(), compare=False, repr=False)
    _creds: frozenset = field(default=frozenset(), compare=False, repr=False)
    _hosts: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        nets = tuple(ipaddress.ip_network(n) for n in self.networks)
        object.__setattr__(self, "_nets", nets)
        creds = frozenset(_parse_spelled(o) for o in self.credentials or ())
        object.__setattr__(self, "_creds", creds)

    def __reduce__(self):  # (the parsed caches are rebuilt, not pickled)
        return (Scope, (self.credentials, self.guard, self.index, self.trusted, self.networks))

    def _host(self, url: str) -> tuple[Origin | None, str | None]:
        """(origin, why a request may not go there, or None) of `url`, worked out once per
        ``scheme://host:port`` (parsing a URL costs ~10 us; a request to the same host
        ~0.3 us for this lookup)."""
        cut = url.find("/", url.find("://") + 3)
        head = url if cut < 0 else url[:cut]
        known = self._hosts.get(head)
        if known is None:
            if len(self._hosts) > 4096:  # (an index naming a million hosts: bounded)
                self._hosts.clear()
            known = self._hosts[head] = (origin_of(head), self._literal_refusal(head))
        return known

    def sends_credentials(self, url: str, asked: str) -> bool:
        """Whether the headers go with a request for `url` (`asked`: the URL first asked
        for, before any redirect)."""
        here = self._host(url)[0]
        if self.credentials is None:
            return here is not None and here == self._host(asked)[0]
        return here in self._creds

    def refuse_literal(self, url: str) -> None:
        """TargetRefused when `url` names an address literally that it may not reach
        (names are checked by :meth:`allowed` once resolved)."""
        if self.guard:
            why = self._host(url)[1]
            if why is not None:
                raise TargetRefused(why)

    def _literal_refusal(self, head: str) -> str | None:
        if not self.guard:
            return None
        parts = urllib.parse.urlsplit(head)
        host = parts.hostname or ""
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return None  # a name: checked where it is resolved
        try:
            port = parts.port or _DEFAULT_PORT.get(parts.scheme.lower(), 0)
        except ValueError:
            port = 0
        try:
            self._check(host, port, [ip])
        except TargetRefused as err:
            return str(err)
        return None

    def allowed(self, host: str, port: int, infos: list[dict]) -> list[dict]:
        """The resolved addresses of (host, port) this scope may connect to (aiohttp's
        resolver results); TargetRefused when none may be reached."""
        if not self.guard:
            return infos
        ips = [ipaddress.ip_address(str(i["host"]).split("%", 1)[0]) for i in infos]
        keep = [i for i, ip in zip(infos, ips, strict=True) if self._reachable(host, port, ip)]
        if not keep:
            self._check(host, port, ips)
        return keep

    def _reachable(self, host: str, port: int, ip) -> bool:
        if f"{host.lower()}:{port}" in self.trusted or address_kind(ip) is None:
            return True
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self._nets)

    def _check(self, host: str, port: int, ips: list) -> None:
        for ip in ips:
            if not self._reachable(host, port, ip):
                kind = address_kind(ip)
                named = host if host == str(ip) else f"{host} ({ip})"
                article = "an" if kind[0] in "aeiou" else "a"
                raise TargetRefused(
                    f"refused: the remote index {self.index} names {named}, {article} {kind} "
                    f"address; a remote index may name its own origin and public addresses "
                    f"only (allow_networks=[{str(ipaddress.ip_network(ip))!r}] allows it)"
                )


def locations_of(index: Any, meta: str | None = None) -> list[str]:
    """The locations (paths, URLs) the user named: a Dataset's `index` argument (a path,
    a URL, a list of them, an Index already opened) and its ``meta`` file."""
    import os

    if isinstance(index, os.PathLike):
        index = os.fspath(index)
    if isinstance(index, str):
        found = [index]
    elif isinstance(index, list | tuple):
        found = [loc for member in index for loc in locations_of(member)]
    elif getattr(index, "members", None):  # a joined Index already opened
        found = [loc for m in index.members for loc in locations_of(m)]
    else:  # an Index already opened, or a tensor (nothing is fetched)
        origin = getattr(index, "origin", None)
        found = [origin] if isinstance(origin, str) else []
    return found + ([meta] if isinstance(meta, str) else [])


def origins_in(urls: Iterable[str]) -> list[Origin]:
    """The distinct origins of the http(s) URLs among `urls` (cheap for a million part
    names on a few hosts: each distinct ``scheme://host:port/`` is parsed once)."""
    heads = set()
    for url in urls:
        if url.startswith(("http://", "https://", "HTTP://", "HTTPS://")):
            end = url.find("/", url.find("://") + 3)
            heads.add(url if end < 0 else url[:end])
    return sorted({o for o in map(origin_of, heads) if o is not None})


def _is_remote(location: str) -> bool:
    return "://" in location[:64] and not location.lower().startswith("file://")


def scope_for(
    locations: Sequence[str],
    headers: Mapping[str, str] | None = None,
    credential_origins: Sequence[str] = (),
    allow_networks: Sequence[str] = (),
    guard: bool | None = None,
) -> Scope:
    """The Scope of reads for what the user named at `locations` (:func:`locations_of`).

    Targets are guarded when a location is remote (unless `guard` says otherwise: the
    part files of a folder the user named are all the user's). Raises ValueError
    where ``headers`` would reach no origin (the index is local and
    ``credential_origins`` names none), so the mistake shows where it is made.
    """
    named = origins_in(locations)
    creds = frozenset({spell_origin(o) for o in named} | set(check_origins(credential_origins)))
    sent = [k for k in headers or {} if k.lower() != "accept-encoding"]
    if sent and not creds:
        where = ", ".join(repr(loc) for loc in locations[:3]) or "the index"
        raise ValueError(
            f"headers {sorted(sent)} would go to no server: {where} is not an http(s) URL, "
            "and headers go only to the origins you name; name them with "
            "credential_origins=['https://host[:port]']"
        )
    remote = [loc for loc in locations if _is_remote(loc)]
    return Scope(
        credentials=creds,
        guard=bool(remote) if guard is None else guard,
        index=", ".join(remote[:3]),
        trusted=frozenset(f"{host}:{port}" for _, host, port in named),
        networks=check_networks(allow_networks),
    )


def resolver(scope: Scope) -> Any:
    """An aiohttp resolver that hands out only the addresses `scope` may reach."""
    import aiohttp

    class GuardedResolver(aiohttp.abc.AbstractResolver):
        def __init__(self) -> None:
            self.inner = aiohttp.DefaultResolver()

        async def resolve(self, host: str, port: int = 0, family=socket.AF_INET):
            return scope.allowed(host, port, await self.inner.resolve(host, port, family))

        async def close(self) -> None:
            await self.inner.close()

    return GuardedResolver()
