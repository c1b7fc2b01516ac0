package guestconf

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// The lines of squid.conf Parse takes as they are (they change no access
// decision).
var fixedLines = map[string]bool{
	"cache deny all":                  true,
	"pinger_enable off":               true,
	"shutdown_lifetime 1 second":      true,
	"coredump_dir /var/spool/squid":   true,
	"auth_param basic realm " + Realm: true,
}

// aclKind is an ACL type Parse understands.
type aclKind int

const (
	aclMethod aclKind = iota + 1
	aclSrc
	aclPort
	aclDstdomain
	aclProxyAuth
	aclAll
)

var aclKinds = map[string]aclKind{
	"method":     aclMethod,
	"src":        aclSrc,
	"port":       aclPort,
	"dstdomain":  aclDstdomain,
	"proxy_auth": aclProxyAuth,
}

// aclDef is one named ACL: its type and the values of all its lines.
type aclDef struct {
	kind     aclKind
	methods  []string
	prefixes []netip.Prefix
	ports    [][2]int // inclusive ranges
	domains  []string // ".x" matches x and every name under it; "x" only x
}

// aclRef is one ACL named on an http_access line, possibly negated.
type aclRef struct {
	name    string
	negated bool
}

// access is one http_access line.
type access struct {
	allow bool
	acls  []aclRef
}

// Config is a guest's Squid as Parse read it from user-data: where it
// listens, with which certificate, and the access rules it decides every
// request with (Decide).
type Config struct {
	// Port is the port of http_port or https_port.
	Port int
	// Certificate is the https_port's certificate and key; nil: plain
	// HTTP.
	Certificate *tls.Certificate

	acls   map[string]*aclDef
	access []access
	users  map[string]string // name: crypt hash
	cache  credentialCache
}

// Parse reads user-data. Without the Marker line (it was not rendered by
// UserData) it returns ok false and no error. Rendered user-data that
// cannot be read, or whose squid.conf holds anything this model does not
// know, is an error; the error never quotes the files' content.
func Parse(userData string) (c *Config, ok bool, err error) {
	head, rest, _ := strings.Cut(userData, "\n")
	second, _, _ := strings.Cut(rest, "\n")
	if head != "#cloud-config" || second != Marker {
		return nil, false, nil
	}
	dec := yaml.NewDecoder(strings.NewReader(userData))
	dec.KnownFields(true)
	var cc cloudConfig
	if err := dec.Decode(&cc); err != nil {
		return nil, true, errors.New("user-data is not the cloud-config of a guest")
	}
	files := map[string]string{}
	for _, f := range cc.WriteFiles {
		if _, dup := files[f.Path]; dup {
			return nil, true, fmt.Errorf("user-data writes %s twice", f.Path)
		}
		files[f.Path] = f.Content
	}
	conf, has := files[SquidConf]
	if !has {
		return nil, true, fmt.Errorf("user-data writes no %s", SquidConf)
	}
	c, err = parseSquid(conf, files)
	return c, true, err
}

// parseSquid reads squid.conf; files are the other files of the user-data
// (password file, certificate and key) by path.
func parseSquid(conf string, files map[string]string) (*Config, error) {
	c := &Config{acls: map[string]*aclDef{"all": {kind: aclAll}}}
	sc := bufio.NewScanner(strings.NewReader(conf))
	n := 0
	for sc.Scan() {
		n++
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		if err := c.directive(strings.Fields(text), files); err != nil {
			return nil, fmt.Errorf("squid.conf line %d: %w", n, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if c.Port == 0 {
		return nil, errors.New("squid.conf has no http_port or https_port")
	}
	return c, nil
}

func (c *Config) directive(w []string, files map[string]string) error {
	if fixedLines[strings.Join(w, " ")] {
		return nil
	}
	switch w[0] {
	case "http_port", "https_port":
		return c.listen(w, files)
	case "acl":
		return c.acl(w)
	case "auth_param":
		return c.auth(w, files)
	case "http_access":
		return c.httpAccess(w)
	}
	return fmt.Errorf("directive %s is not part of the guest contract", strconv.Quote(w[0]))
}

func (c *Config) listen(w []string, files map[string]string) error {
	if c.Port != 0 {
		return errors.New("a second listening port")
	}
	if len(w) < 2 {
		return fmt.Errorf("%s without a port", w[0])
	}
	port, err := strconv.Atoi(w[1])
	if err != nil || port < 1 || port > 65535 {
		return fmt.Errorf("%s %s: not a port", w[0], strconv.Quote(w[1]))
	}
	c.Port = port
	if w[0] == "http_port" {
		if len(w) != 2 {
			return errors.New("http_port takes only a port")
		}
		return nil
	}
	if len(w) != 4 || w[2] != "tls-cert="+CertFile || w[3] != "tls-key="+KeyFile {
		return fmt.Errorf("https_port must name tls-cert=%s tls-key=%s", CertFile, KeyFile)
	}
	cert, err := tls.X509KeyPair([]byte(files[CertFile]), []byte(files[KeyFile]))
	if err != nil {
		return errors.New("https_port: the user-data's certificate and key are not a usable pair")
	}
	c.Certificate = &cert
	return nil
}

func (c *Config) acl(w []string) error {
	if len(w) < 4 {
		return errors.New("acl without a name, type and values")
	}
	name, typ, values := w[1], w[2], w[3:]
	kind, ok := aclKinds[typ]
	if !ok {
		return fmt.Errorf("acl type %s is not part of the guest contract", strconv.Quote(typ))
	}
	if name == "all" {
		return errors.New("acl all is predefined")
	}
	if kind == aclDstdomain {
		// Without -n Squid would look the names of IP targets up in the
		// DNS; the contract never asks it to.
		if values[0] != "-n" || len(values) < 2 {
			return errors.New("dstdomain without -n and values")
		}
		values = values[1:]
	}
	d, ok := c.acls[name]
	switch {
	case !ok:
		d = &aclDef{kind: kind}
		c.acls[name] = d
	case d.kind != kind:
		return fmt.Errorf("acl %s redefined with another type", name)
	}
	for _, v := range values {
		if err := d.add(v); err != nil {
			return fmt.Errorf("acl %s: %w", name, err)
		}
	}
	return nil
}

func (d *aclDef) add(v string) error {
	switch d.kind {
	case aclMethod:
		if v != "CONNECT" {
			return fmt.Errorf("method %s", strconv.Quote(v))
		}
		d.methods = append(d.methods, v)
	case aclSrc:
		p, err := netip.ParsePrefix(v)
		if err != nil {
			a, aerr := netip.ParseAddr(v)
			if aerr != nil {
				return fmt.Errorf("src %s", strconv.Quote(v))
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		d.prefixes = append(d.prefixes, p.Masked())
	case aclPort:
		lo, hi, isRange := strings.Cut(v, "-")
		a, err1 := strconv.Atoi(lo)
		b := a
		var err2 error
		if isRange {
			b, err2 = strconv.Atoi(hi)
		}
		if err1 != nil || err2 != nil || a < 1 || b > 65535 || a > b {
			return fmt.Errorf("port %s", strconv.Quote(v))
		}
		d.ports = append(d.ports, [2]int{a, b})
	case aclDstdomain:
		d.domains = append(d.domains, strings.ToLower(v))
	case aclProxyAuth:
		if v != "REQUIRED" {
			return errors.New("proxy_auth takes REQUIRED only")
		}
	}
	return nil
}

func (c *Config) auth(w []string, files map[string]string) error {
	if len(w) != 5 || w[1] != "basic" || w[2] != "program" || w[3] != AuthHelper || w[4] != PasswdFile {
		return fmt.Errorf("auth_param must be: basic program %s %s", AuthHelper, PasswdFile)
	}
	if c.users != nil {
		return errors.New("a second auth_param program")
	}
	pw, ok := files[PasswdFile]
	if !ok {
		return fmt.Errorf("user-data writes no %s", PasswdFile)
	}
	c.users = map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader([]byte(pw)))
	for n := 1; sc.Scan(); n++ {
		name, hash, ok := strings.Cut(sc.Text(), ":")
		if !ok || name == "" || !strings.HasPrefix(hash, "$6$") {
			return fmt.Errorf("%s line %d is not name:sha512-crypt", PasswdFile, n)
		}
		c.users[name] = hash
	}
	return nil
}

func (c *Config) httpAccess(w []string) error {
	if len(w) < 3 || (w[1] != "allow" && w[1] != "deny") {
		return errors.New("http_access must be allow or deny and ACLs")
	}
	a := access{allow: w[1] == "allow"}
	for _, ref := range w[2:] {
		r := aclRef{name: ref}
		if rest, ok := strings.CutPrefix(ref, "!"); ok {
			r = aclRef{name: rest, negated: true}
		}
		d, ok := c.acls[r.name]
		if !ok {
			return fmt.Errorf("http_access names an undefined acl %s", strconv.Quote(r.name))
		}
		if d.kind == aclProxyAuth && c.users == nil {
			return errors.New("proxy_auth without an auth_param program")
		}
		a.acls = append(a.acls, r)
	}
	c.access = append(c.access, a)
	return nil
}

// Authenticated reports whether c asks for credentials at all.
func (c *Config) Authenticated() bool { return c.users != nil }

// Usernames returns the users of the password file, sorted.
func (c *Config) Usernames() []string {
	var out []string
	for n := range c.users {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}
