"""Just enough SDP (RFC 4566) for the offer/answer model (RFC 3264) with one G.711 audio stream."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from voice.transports.rtp import STATIC_PT


class SdpError(ValueError):
    pass


@dataclass
class MediaOffer:
    kind: str  # audio, video, image...
    port: int
    proto: str
    formats: list[str]
    rtpmap: dict[int, tuple[str, int]] = field(default_factory=dict)  # pt -> (encoding, rate)
    address: str = ""  # c= of the media section, else the session's
    direction: str = "sendrecv"
    ptime: int | None = None


@dataclass
class Offer:
    address: str  # session-level c=
    media: list[MediaOffer]  # every m= line, in order (the answer has one line per offered line)

    def encoding(self, media: MediaOffer, fmt: str) -> tuple[str, int] | None:
        if not (fmt.isascii() and fmt.isdigit()) or int(fmt) > 127:  # RTP payload types are 7 bits
            return None
        pt = int(fmt)
        if pt in media.rtpmap:
            return media.rtpmap[pt]
        for name, static in STATIC_PT.items():
            if pt == static:
                return name, 8000
        return None


@dataclass
class Answer:
    codec: str  # PCMU | PCMA
    payload_type: int
    dtmf_pt: int | None
    remote: tuple[str, int]  # where to send RTP
    media: MediaOffer
    index: int  # which m= line of the offer
    offer: Offer


def parse(text: str) -> Offer:
    session_addr = ""
    media: list[MediaOffer] = []
    current: MediaOffer | None = None
    seen_v = False
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = raw.strip()
        if not line:
            continue
        if len(line) < 2 or line[1] != "=":
            raise SdpError(f"bad SDP line {line[:40]!r}")
        kind, value = line[0], line[2:]
        if kind == "v":
            seen_v = True
        elif kind == "c":
            parts = value.split()
            if len(parts) != 3 or parts[0] != "IN" or parts[1] not in ("IP4", "IP6"):
                raise SdpError(f"bad c= line {value!r}")
            addr = parts[2].split("/")[0]
            try:  # only literal addresses: a host name would mean DNS lookups, and RTP sent who knows where
                ipaddress.ip_address(addr)
            except ValueError as err:
                raise SdpError(f"c= must hold an IP address, not {addr[:60]!r}") from err
            if current is None:
                session_addr = addr
            else:
                current.address = addr
        elif kind == "m":
            parts = value.split()
            if len(parts) < 4:
                raise SdpError(f"bad m= line {value!r}")
            port_text = parts[1].split("/")[0]
            if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
                raise SdpError(f"bad m= port {parts[1][:20]!r}")
            port = int(port_text)
            current = MediaOffer(parts[0], port, parts[2], parts[3:])
            media.append(current)
        elif kind == "a" and current is not None:
            name, _, arg = value.partition(":")
            if name == "rtpmap":
                pt, _, enc = arg.partition(" ")
                bits = enc.split("/")
                if not (pt.isascii() and pt.isdigit() and int(pt) < 128):
                    continue
                try:
                    current.rtpmap[int(pt)] = (bits[0].upper(), int(bits[1]) if len(bits) > 1 else 8000)
                except ValueError:
                    continue
            elif name in ("sendrecv", "sendonly", "recvonly", "inactive"):
                current.direction = name
            elif name == "ptime":
                try:
                    current.ptime = int(float(arg))
                except (ValueError, OverflowError):  # "nan", "inf"
                    pass
    if not seen_v:
        raise SdpError("no v= line")
    for m in media:
        if not m.address:
            m.address = session_addr
    return Offer(session_addr, media)


def negotiate(offer: Offer, codecs: list[str]) -> Answer | None:
    """The first audio stream and the first of its formats that we speak (offer order wins)."""
    for index, media in enumerate(offer.media):
        if media.kind != "audio" or media.port == 0 or media.proto.upper() != "RTP/AVP":
            continue
        dtmf = next((int(f) for f in media.formats
                     if (offer.encoding(media, f) or ("", 0)) == ("TELEPHONE-EVENT", 8000)), None)
        for f in media.formats:
            enc = offer.encoding(media, f)
            if enc and enc[0] in codecs and enc[1] == 8000:
                return Answer(enc[0], int(f), dtmf, (media.address, media.port), media, index, offer)
    return None


def answer_sdp(ans: Answer, address: str, port: int, session_id: int, version: int) -> str:
    """Our answer: one audio stream with the chosen codec (and telephone-event if offered)."""
    ip = "IP6" if ipaddress.ip_address(address).version == 6 else "IP4"
    fmts = [ans.payload_type] + ([ans.dtmf_pt] if ans.dtmf_pt is not None else [])
    direction = {"sendonly": "recvonly", "recvonly": "sendonly", "inactive": "inactive"}.get(
        ans.media.direction, "sendrecv")
    lines = ["v=0", f"o=diffusion-voice {session_id} {version} IN {ip} {address}", "s=diffusion-voice",
             f"c=IN {ip} {address}", "t=0 0"]
    for index, media in enumerate(ans.offer.media):
        if index != ans.index:  # refused (RFC 3264 section 6): same line, port 0
            lines.append(f"m={media.kind} 0 {media.proto} {media.formats[0] if media.formats else '0'}")
            continue
        lines += [f"m=audio {port} RTP/AVP {' '.join(map(str, fmts))}", f"a=rtpmap:{ans.payload_type} {ans.codec}/8000"]
        if ans.dtmf_pt is not None:
            lines += [f"a=rtpmap:{ans.dtmf_pt} telephone-event/8000", f"a=fmtp:{ans.dtmf_pt} 0-16"]
        lines += ["a=ptime:20", f"a={direction}"]
    return "\r\n".join(lines) + "\r\n"
