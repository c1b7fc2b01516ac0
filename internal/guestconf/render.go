package guestconf

import (
	"bytes"
	"cmp"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Where the guest's files go, and what the image must provide.
const (
	// Marker is the user-data's second line: it says the user-data was
	// rendered by this contract (cloud-init reads it as a comment).
	Marker     = "# egressproxy guest v1"
	SquidConf  = "/etc/squid/squid.conf"
	PasswdFile = "/etc/squid/passwd"
	CertFile   = "/etc/squid/tls/proxy.crt"
	KeyFile    = "/etc/squid/tls/proxy.key"
	// AuthHelper is Squid's basic authentication helper for a password
	// file of crypt(3) hashes.
	AuthHelper = "/usr/lib/squid/basic_ncsa_auth"
	// Realm is the basic authentication realm the proxy names.
	Realm = "egressproxy"
)

// The names of the ACLs UserData defines.
const (
	aclConnect = "egp_connect"
	aclClients = "egp_clients"
	aclUsers   = "egp_users"
	aclDest    = "egp_dest"
)

// valuesPerLine bounds the values of one acl line (Squid joins the lines
// of one ACL).
const valuesPerLine = 16

// tail are the lines every configuration ends with: nothing is cached, no
// ICMP pinger, a quick stop.
var tail = []string{
	"cache deny all",
	"pinger_enable off",
	"shutdown_lifetime 1 second",
	"coredump_dir /var/spool/squid",
}

// Policy is a guest's proxy, resolved: every value checked, passwords
// hashed. UserData normalises it (sorts, drops duplicates and what another
// entry already covers) before it writes it.
type Policy struct {
	// Port Squid listens on (1-65535).
	Port int
	// Users and their crypt(3) hashes; empty: no authentication.
	Users []User
	// Clients are the client address ranges allowed; empty: any.
	Clients []netip.Prefix
	// Rules are the allowed destinations, at least one: a CONNECT is
	// allowed when one rule allows it.
	Rules []Rule
	// CertPEM and KeyPEM, when CertPEM is not empty, make the port
	// TLS-only (Squid's https_port).
	CertPEM, KeyPEM string
}

// User is one proxy user and the crypt(3) hash of its password.
type User struct{ Name, Hash string }

// Rule allows CONNECT to one of Ports on a host named by one of Domains (a
// domain allows itself and every name under it), or on any host when
// Domains is empty.
type Rule struct {
	Ports   []int
	Domains []string
}

// Normalize returns p with every list sorted and without duplicates;
// client ranges inside another listed range and domains under another
// domain of the same rule are dropped (Squid warns about both, and they
// allow nothing more). Rules with the same domains are merged.
func Normalize(p Policy) Policy {
	out := p
	out.Users = slices.Clone(p.Users)
	slices.SortFunc(out.Users, func(a, b User) int { return strings.Compare(a.Name, b.Name) })
	out.Users = slices.CompactFunc(out.Users, func(a, b User) bool { return a.Name == b.Name })
	out.Clients = normalizePrefixes(p.Clients)
	merged := map[string]*Rule{}
	var keys []string
	for _, r := range p.Rules {
		doms := normalizeDomains(r.Domains)
		k := strings.Join(doms, " ")
		m, ok := merged[k]
		if !ok {
			m = &Rule{Domains: doms}
			merged[k] = m
			keys = append(keys, k)
		}
		m.Ports = append(m.Ports, r.Ports...)
	}
	slices.Sort(keys)
	out.Rules = nil
	for _, k := range keys {
		r := merged[k]
		slices.Sort(r.Ports)
		r.Ports = slices.Compact(r.Ports)
		out.Rules = append(out.Rules, *r)
	}
	return out
}

// normalizePrefixes sorts ps (masked), drops duplicates and ranges another
// one contains.
func normalizePrefixes(ps []netip.Prefix) []netip.Prefix {
	in := make([]netip.Prefix, 0, len(ps))
	for _, p := range ps {
		in = append(in, p.Masked())
	}
	// Wider ranges first, so a range is kept only when no kept one
	// contains it.
	slices.SortFunc(in, func(a, b netip.Prefix) int {
		return cmp.Or(cmp.Compare(a.Bits(), b.Bits()), a.Addr().Compare(b.Addr()))
	})
	var out []netip.Prefix
	for _, p := range in {
		covered := false
		for _, k := range out {
			if k.Addr().Is4() == p.Addr().Is4() && k.Bits() <= p.Bits() && k.Contains(p.Addr()) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		return cmp.Or(a.Addr().Compare(b.Addr()), cmp.Compare(a.Bits(), b.Bits()))
	})
	return out
}

// normalizeDomains lowercases, sorts and drops duplicates and names under
// another listed name.
func normalizeDomains(ds []string) []string {
	in := make([]string, 0, len(ds))
	for _, d := range ds {
		in = append(in, strings.ToLower(d))
	}
	slices.Sort(in)
	in = slices.Compact(in)
	var out []string
	for _, d := range in {
		covered := false
		for _, o := range in {
			if o != d && strings.HasSuffix(d, "."+o) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, d)
		}
	}
	return out
}

// Squid returns the Squid configuration of p (normalised): CONNECT only,
// from the client ranges only, with valid credentials only (407 otherwise),
// to the allowed destinations only; everything else is denied (403).
func Squid(p Policy) string {
	p = Normalize(p)
	var b strings.Builder
	line := func(words ...string) {
		b.WriteString(strings.Join(words, " "))
		b.WriteByte('\n')
	}
	acl := func(name, typ string, values []string) {
		for chunk := range slices.Chunk(values, valuesPerLine) {
			line(append([]string{"acl", name, typ}, chunk...)...)
		}
	}
	b.WriteString("# Written from the proxy's description: CONNECT only, to the allowed\n# destinations only; every other request is denied.\n")
	port := strconv.Itoa(p.Port)
	if p.CertPEM != "" {
		line("https_port", port, "tls-cert="+CertFile, "tls-key="+KeyFile)
	} else {
		line("http_port", port)
	}
	line("acl", aclConnect, "method", "CONNECT")
	if len(p.Clients) > 0 {
		vs := make([]string, len(p.Clients))
		for i, c := range p.Clients {
			vs[i] = c.String()
		}
		acl(aclClients, "src", vs)
	}
	if len(p.Users) > 0 {
		line("auth_param", "basic", "program", AuthHelper, PasswdFile)
		line("auth_param", "basic", "realm", Realm)
		line("acl", aclUsers, "proxy_auth", "REQUIRED")
	}
	var allow [][]string
	for i, r := range p.Rules {
		name := aclDest + strconv.Itoa(i+1)
		ports := make([]string, len(r.Ports))
		for j, pt := range r.Ports {
			ports[j] = strconv.Itoa(pt)
		}
		acl(name+"_ports", "port", ports)
		refs := []string{name + "_ports"}
		if len(r.Domains) > 0 {
			doms := make([]string, len(r.Domains))
			for j, d := range r.Domains {
				doms[j] = "." + d
			}
			acl(name+"_domains", "dstdomain -n", doms)
			refs = append(refs, name+"_domains")
		}
		allow = append(allow, refs)
	}
	line("http_access", "deny", "!"+aclConnect)
	if len(p.Clients) > 0 {
		line("http_access", "deny", "!"+aclClients)
	}
	if len(p.Users) > 0 {
		// The last ACL of a deny line is an authentication ACL: missing or
		// wrong credentials are answered 407.
		line("http_access", "deny", "!"+aclUsers)
	}
	for _, refs := range allow {
		line(append([]string{"http_access", "allow"}, refs...)...)
	}
	line("http_access", "deny", "all")
	for _, l := range tail {
		line(l)
	}
	return b.String()
}

// writeFile is one entry of cloud-init's write_files.
type writeFile struct {
	Path        string `yaml:"path"`
	Owner       string `yaml:"owner,omitempty"`
	Permissions string `yaml:"permissions"`
	Content     string `yaml:"content"`
}

type cloudConfig struct {
	WriteFiles []writeFile `yaml:"write_files"`
}

// UserData returns the cloud-config that writes p's files: squid.conf,
// and with users the password file, with TLS the certificate and key (the
// secrets readable by root and Squid's group only).
func UserData(p Policy) (string, error) {
	p = Normalize(p)
	files := []writeFile{{Path: SquidConf, Owner: "root:root", Permissions: "0644", Content: Squid(p)}}
	if len(p.Users) > 0 {
		var pw strings.Builder
		for _, u := range p.Users {
			pw.WriteString(u.Name + ":" + u.Hash + "\n")
		}
		files = append(files, writeFile{Path: PasswdFile, Owner: "root:proxy", Permissions: "0640", Content: pw.String()})
	}
	if p.CertPEM != "" {
		files = append(files,
			writeFile{Path: CertFile, Owner: "root:root", Permissions: "0644", Content: p.CertPEM},
			writeFile{Path: KeyFile, Owner: "root:proxy", Permissions: "0640", Content: p.KeyPEM})
	}
	var b bytes.Buffer
	b.WriteString("#cloud-config\n" + Marker + "\n")
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(cloudConfig{WriteFiles: files}); err != nil {
		return "", err
	}
	if err := enc.Close(); err != nil {
		return "", err
	}
	return b.String(), nil
}
