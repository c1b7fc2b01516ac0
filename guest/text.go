package guest

import (
	"strconv"
	"strings"
)

// String returns the description without secrets: each password and the
// TLS key show as REDACTED. Every fmt verb uses it (or GoString).
func (c Config) String() string {
	var b strings.Builder
	b.WriteString("{")
	field := func(name, value string) {
		if b.Len() > 1 {
			b.WriteByte(' ')
		}
		b.WriteString(name + ":" + value)
	}
	if c.Port != 0 {
		field("Port", strconv.Itoa(c.Port))
	}
	if len(c.Users) > 0 {
		us := make([]string, len(c.Users))
		for i, u := range c.Users {
			us[i] = u.String()
		}
		field("Users", "["+strings.Join(us, " ")+"]")
	}
	if len(c.AllowedClients) > 0 {
		field("AllowedClients", quoted(c.AllowedClients))
	}
	if len(c.AllowedDestinations) > 0 {
		ds := make([]string, len(c.AllowedDestinations))
		for i, d := range c.AllowedDestinations {
			ds[i] = destinationText(d)
		}
		field("AllowedDestinations", "["+strings.Join(ds, " ")+"]")
	}
	if c.TLS != nil {
		field("TLS", c.TLS.String())
	}
	if c.Open {
		field("Open", "true")
	}
	return b.String() + "}"
}

// GoString is String for %#v.
func (c Config) GoString() string { return "guest.Config" + c.String() }

// String returns the user's name; the password shows as REDACTED.
func (u User) String() string {
	s := "{Name:" + strconv.Quote(u.Name)
	if u.Password != "" {
		s += " Password:REDACTED"
	}
	return s + "}"
}

// GoString is String for %#v.
func (u User) GoString() string { return "guest.User" + u.String() }

// destinationText is d as String shows it.
func destinationText(d Destination) string {
	var parts []string
	if len(d.Ports) > 0 {
		ps := make([]string, len(d.Ports))
		for i, p := range d.Ports {
			ps[i] = strconv.Itoa(p)
		}
		parts = append(parts, "Ports:["+strings.Join(ps, " ")+"]")
	}
	if len(d.Domains) > 0 {
		parts = append(parts, "Domains:"+quoted(d.Domains))
	}
	return "{" + strings.Join(parts, " ") + "}"
}

// String shows whether a certificate and a key are set; the key shows as
// REDACTED, the certificate as its length.
func (t TLS) String() string {
	var parts []string
	if t.Certificate != "" {
		parts = append(parts, "Certificate:"+strconv.Itoa(len(t.Certificate))+" bytes")
	}
	if t.Key != "" {
		parts = append(parts, "Key:REDACTED")
	}
	return "{" + strings.Join(parts, " ") + "}"
}

// GoString is String for %#v.
func (t TLS) GoString() string { return "guest.TLS" + t.String() }

func quoted(ss []string) string {
	qs := make([]string, len(ss))
	for i, s := range ss {
		qs[i] = strconv.Quote(s)
	}
	return "[" + strings.Join(qs, " ") + "]"
}
