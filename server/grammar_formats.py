"""JSON Schema's string formats that guided decoding enforces, each as a pattern in the regex subset that `pattern`
takes (matched over the string's decoded characters). Each admits only valid texts of its format, though not every
one (a day past its month's end is admitted; quoted local parts of an email, for one, are not)."""

from __future__ import annotations

OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # a hostname's label: 1 to 63 characters
DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"  # RFC 3339 full-date
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
DURATION_TIME = r"T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
DURATION_DATE = r"(?:[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)"
ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
HEX = "[0-9a-fA-F]"

FORMAT_PATTERNS = {
    "date": DATE,
    "time": TIME,
    "date-time": DATE + "[Tt]" + TIME,
    "duration": rf"P(?:{DURATION_DATE}(?:{DURATION_TIME})?|{DURATION_TIME}|[0-9]+W)",  # RFC 3339 appendix A
    "uuid": rf"{HEX}{{8}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{12}}",
    "ipv4": rf"(?:{OCTET}\.){{3}}{OCTET}",
    "hostname": rf"{LABEL}(?:\.{LABEL})*",
    "email": rf"{ATOM}(?:\.{ATOM})*@{LABEL}(?:\.{LABEL})+",  # dot-atom local part, a domain of two labels or more
}
