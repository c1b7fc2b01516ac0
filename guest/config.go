package guest

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// Bounds of a Config's lists.
const (
	maxUsers        = 64
	maxClients      = 256
	maxDestinations = 64
	maxPorts        = 64
	maxDomains      = 256
	maxNameBytes    = 64
	maxPasswordLen  = 256
	maxDomainBytes  = 253
	minRSABits      = 2048
)

// Config describes the proxy of one guest. Its zero value is invalid:
// a proxy needs Users or AllowedClients, or Open set.
type Config struct {
	// Port the proxy listens on in the guest: 1-65535; zero means 3128
	// (egressproxy.DefaultPort). The Spec's Port must be the same.
	Port int `json:"port,omitempty"`
	// Users may use the proxy with HTTP basic proxy authentication; others
	// are answered 407. Empty: no credentials are asked for.
	Users []User `json:"users,omitempty"`
	// AllowedClients are the client address ranges the proxy serves, each
	// an address ("192.0.2.7") or a CIDR prefix without host bits
	// ("10.0.0.0/8", "2001:db8::/32"); clients outside them are answered
	// 403. A client must be in a range and, with Users, authenticate.
	// Empty: any client.
	AllowedClients []string `json:"allowedClients,omitempty"`
	// AllowedDestinations are where CONNECT may go; a CONNECT that no
	// entry allows is answered 403. Empty: port 443 on any host.
	AllowedDestinations []Destination `json:"allowedDestinations,omitempty"`
	// TLS, when set, makes the port speak TLS only: clients connect to
	// an HTTPS proxy. Nil: plain HTTP.
	TLS *TLS `json:"tls,omitempty"`
	// Open allows a proxy with neither Users nor AllowedClients: it then
	// tunnels, to the allowed destinations, for anyone who reaches its
	// port. It must be false when Users or AllowedClients is set. False
	// (the default): such a Config is invalid.
	Open bool `json:"open,omitempty"`
}

// User is one user of the proxy.
type User struct {
	// Name is the user name: 1-64 of letters, digits, '.', '_', '-', '@'
	// and '+'; unique among Users.
	Name string `json:"name"`
	// Password is the user's password: 1-256 bytes without control
	// characters. Only its SHA-512 crypt hash reaches the guest; it is
	// never marshalled or printed.
	Password string `json:"-"`
}

// Destination allows CONNECT to some ports, on some domains or any host.
type Destination struct {
	// Ports are the allowed target ports, each 1-65535. Empty: 443.
	Ports []int `json:"ports,omitempty"`
	// Domains restricts the destination to targets named by one of these
	// domains or a name under one ("example.com" allows example.com and
	// api.example.com); a target given as an IP address never matches.
	// Each is a DNS name, without a leading dot or wildcard. Empty: any
	// host, names and addresses alike.
	Domains []string `json:"domains,omitempty"`
}

// TLS is the certificate and key the proxy serves TLS with.
type TLS struct {
	// Certificate is the PEM certificate chain, the proxy's own
	// certificate first. Clients verify the proxy against it: give it a
	// name or address they connect to.
	Certificate string `json:"certificate"`
	// Key is the PEM private key of the first certificate (RSA of at
	// least 2048 bits, ECDSA P-256 or P-384, or Ed25519). It is never
	// marshalled or printed.
	Key string `json:"-"`
}

// Validate checks every field and returns all violations joined, each a
// *egressproxy.FieldError named by its Go field path (Users[1].Name,
// AllowedDestinations[0].Ports[2], TLS.Key), classed Permanent; nil when
// c is valid. A password or key is never quoted.
func (c Config) Validate() error {
	var v validator
	if c.Port < 0 || c.Port > 65535 {
		v.bad("Port", strconv.Itoa(c.Port), "must be 0 (3128) or 1-65535")
	}
	v.users(c.Users)
	v.clients(c.AllowedClients)
	v.destinations(c.AllowedDestinations)
	if c.TLS != nil {
		v.tls(*c.TLS)
	}
	restricted := len(c.Users) > 0 || len(c.AllowedClients) > 0
	switch {
	case c.Open && restricted:
		v.bad("Open", "", "must be false when Users or AllowedClients restrict the proxy")
	case !c.Open && !restricted:
		v.bad("Users", "", "is empty and so is AllowedClients: set one of them, or set Open to true to serve anyone who reaches the port")
	}
	if len(v.problems) == 0 {
		return nil
	}
	return errs.WithCode(errs.Permanent, errors.Join(v.problems...))
}

type validator struct{ problems []error }

func (v *validator) bad(field, value, rule string) {
	v.problems = append(v.problems, &errs.FieldError{Field: field, Value: value, Rule: rule})
}

func (v *validator) users(us []User) {
	if len(us) > maxUsers {
		v.bad("Users", "", fmt.Sprintf("has %d users, at most %d allowed", len(us), maxUsers))
	}
	seen := map[string]bool{}
	for i, u := range us {
		f := fmt.Sprintf("Users[%d]", i)
		switch {
		case !validName(u.Name):
			v.bad(f+".Name", u.Name, fmt.Sprintf("must be 1-%d of letters, digits, '.', '_', '-', '@' and '+'", maxNameBytes))
		case seen[u.Name]:
			v.bad(f+".Name", u.Name, "is given twice")
		}
		seen[u.Name] = true
		switch {
		case u.Password == "":
			v.bad(f+".Password", "", "must be set")
		case len(u.Password) > maxPasswordLen:
			v.bad(f+".Password", "", fmt.Sprintf("must be at most %d bytes", maxPasswordLen))
		case hasControl(u.Password):
			v.bad(f+".Password", "", "must not contain control characters")
		}
	}
}

func validName(s string) bool {
	if s == "" || len(s) > maxNameBytes {
		return false
	}
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		case strings.ContainsRune("._-@+", r):
		default:
			return false
		}
	}
	return true
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < ' ' || r == 0x7f {
			return true
		}
	}
	return false
}

func (v *validator) clients(cs []string) {
	if len(cs) > maxClients {
		v.bad("AllowedClients", "", fmt.Sprintf("has %d ranges, at most %d allowed", len(cs), maxClients))
	}
	for i, c := range cs {
		if _, err := parseClient(c); err != nil {
			v.bad(fmt.Sprintf("AllowedClients[%d]", i), c, err.Error())
		}
	}
}

// parseClient reads an address or a prefix without host bits.
func parseClient(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return netip.Prefix{}, errors.New(`must be an address or a CIDR prefix ("10.0.0.0/8")`)
		}
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, errors.New(`must be an address or a CIDR prefix ("10.0.0.0/8")`)
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, errors.New("must not be an IPv4-mapped IPv6 prefix: write the IPv4 prefix")
	}
	if p != p.Masked() {
		return netip.Prefix{}, fmt.Errorf("has host bits set: the range is %s", p.Masked())
	}
	return p, nil
}

func (v *validator) destinations(ds []Destination) {
	if len(ds) > maxDestinations {
		v.bad("AllowedDestinations", "", fmt.Sprintf("has %d entries, at most %d allowed", len(ds), maxDestinations))
	}
	for i, d := range ds {
		f := fmt.Sprintf("AllowedDestinations[%d]", i)
		if len(d.Ports) > maxPorts {
			v.bad(f+".Ports", "", fmt.Sprintf("has %d ports, at most %d allowed", len(d.Ports), maxPorts))
		}
		for j, p := range d.Ports {
			if p < 1 || p > 65535 {
				v.bad(fmt.Sprintf("%s.Ports[%d]", f, j), strconv.Itoa(p), "must be 1-65535")
			}
		}
		if len(d.Domains) > maxDomains {
			v.bad(f+".Domains", "", fmt.Sprintf("has %d domains, at most %d allowed", len(d.Domains), maxDomains))
		}
		for j, dom := range d.Domains {
			if rule := domainRule(dom); rule != "" {
				v.bad(fmt.Sprintf("%s.Domains[%d]", f, j), dom, rule)
			}
		}
	}
}

// domainRule says what is wrong with a domain, "" when nothing.
func domainRule(d string) string {
	switch {
	case strings.HasPrefix(d, "."), strings.HasPrefix(d, "*"):
		return "must be a domain name without a leading dot or wildcard: it allows itself and every name under it"
	case d == "" || len(d) > maxDomainBytes:
		return fmt.Sprintf("must be a DNS name of 1-%d bytes", maxDomainBytes)
	}
	if _, err := netip.ParseAddr(d); err == nil {
		return "must be a domain name, not an address (a destination without Domains allows addresses)"
	}
	for _, label := range strings.Split(d, ".") {
		if !validLabel(label) {
			return "must be a DNS name: labels of 1-63 letters, digits and '-', not starting or ending with '-'"
		}
	}
	return ""
}

func validLabel(l string) bool {
	if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
		return false
	}
	for i := 0; i < len(l); i++ {
		c := l[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

func (v *validator) tls(t TLS) {
	certs, err := certificates(t.Certificate)
	if err != nil {
		v.bad("TLS.Certificate", "", err.Error())
	}
	key, err := privateKey(t.Key)
	if err != nil {
		v.bad("TLS.Key", "", err.Error())
	}
	if certs == "" || key == "" {
		return
	}
	if _, err := tls.X509KeyPair([]byte(certs), []byte(key)); err != nil {
		v.bad("TLS.Key", "", "is not the key of the first certificate")
	}
}

// certificates returns s's certificates re-encoded: only CERTIFICATE
// blocks, each a certificate x509 parses.
func certificates(s string) (string, error) {
	var out strings.Builder
	rest := []byte(s)
	n := 0
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if strings.Contains(b.Type, "PRIVATE KEY") {
			return "", errors.New("holds a private key: it belongs in TLS.Key, and the certificate here")
		}
		if b.Type != "CERTIFICATE" {
			return "", fmt.Errorf("must hold only CERTIFICATE PEM blocks, found %s", strconv.Quote(b.Type))
		}
		if _, err := x509.ParseCertificate(b.Bytes); err != nil {
			return "", fmt.Errorf("block %d is not a certificate", n+1)
		}
		out.Write(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: b.Bytes}))
		n++
	}
	if n == 0 {
		return "", errors.New("must be a PEM certificate chain")
	}
	if strings.TrimSpace(string(rest)) != "" {
		return "", errors.New("holds text that is not PEM")
	}
	return out.String(), nil
}

// privateKey returns s's one private key re-encoded as PKCS #8. Its
// errors never quote the key.
func privateKey(s string) (string, error) {
	b, rest := pem.Decode([]byte(s))
	if b == nil {
		return "", errors.New("must be one PEM private key")
	}
	if next, _ := pem.Decode(rest); next != nil || strings.TrimSpace(string(rest)) != "" {
		return "", errors.New("must hold exactly one PEM block")
	}
	var key any
	var err error
	switch b.Type {
	case "PRIVATE KEY":
		key, err = x509.ParsePKCS8PrivateKey(b.Bytes)
	case "RSA PRIVATE KEY":
		key, err = x509.ParsePKCS1PrivateKey(b.Bytes)
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(b.Bytes)
	default:
		return "", errors.New("must be a PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY PEM block")
	}
	if err != nil {
		return "", errors.New("is not a private key")
	}
	switch k := key.(type) {
	case *rsa.PrivateKey:
		if k.N.BitLen() < minRSABits {
			return "", fmt.Errorf("is an RSA key of %d bits, at least %d needed", k.N.BitLen(), minRSABits)
		}
	case *ecdsa.PrivateKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return "", errors.New("is an ECDSA key on a curve other than P-256 and P-384")
		}
	case ed25519.PrivateKey:
	default:
		return "", errors.New("must be an RSA, ECDSA or Ed25519 key")
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return "", errors.New("cannot be encoded as PKCS #8")
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})), nil
}
