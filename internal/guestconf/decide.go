package guestconf

import (
	"encoding/base64"
	"net/http"
	"net/netip"
	"strings"
	"sync"

	"github.com/GehirnInc/crypt/sha512_crypt"
)

// Request is what Squid decides a request by.
type Request struct {
	// Client is the address the connection came from.
	Client netip.Addr
	// Method is the request's method ("CONNECT").
	Method string
	// Host and Port are the CONNECT target: a name, or an address without
	// brackets.
	Host string
	Port int
	// Authorization is the Proxy-Authorization header's value, "" when
	// none was sent.
	Authorization string
}

// credentialCache remembers whether each Proxy-Authorization header was
// valid, as Squid caches credentials: a crypt hash is computed once per
// distinct header, not per request. It forgets everything when full.
type credentialCache struct {
	mu sync.Mutex
	ok map[string]bool
}

// maxRemembered bounds the cache.
const maxRemembered = 256

// Decide answers r as Squid answers it with c: http.StatusOK (the tunnel
// opens), http.StatusForbidden or http.StatusProxyAuthRequired. The
// http_access lines are read top to bottom and the first whose ACLs all
// match decides; an authentication ACL reached without valid credentials
// ends the check with 407; when no line matches, the answer is the
// opposite of the last line's.
func (c *Config) Decide(r Request) int {
	for _, a := range c.access {
		matched := true
		for _, ref := range a.acls {
			d := c.acls[ref.name]
			if d.kind == aclProxyAuth {
				if !c.valid(r.Authorization) {
					return http.StatusProxyAuthRequired
				}
				if ref.negated {
					matched = false
					break
				}
				continue
			}
			if d.match(r) == ref.negated {
				matched = false
				break
			}
		}
		if matched {
			if a.allow {
				return http.StatusOK
			}
			return http.StatusForbidden
		}
	}
	if n := len(c.access); n > 0 && !c.access[n-1].allow {
		return http.StatusOK
	}
	return http.StatusForbidden
}

func (d *aclDef) match(r Request) bool {
	switch d.kind {
	case aclAll:
		return true
	case aclMethod:
		for _, m := range d.methods {
			if m == r.Method {
				return true
			}
		}
	case aclSrc:
		a := r.Client.Unmap()
		for _, p := range d.prefixes {
			if p.Contains(a) {
				return true
			}
		}
	case aclPort:
		for _, pr := range d.ports {
			if r.Port >= pr[0] && r.Port <= pr[1] {
				return true
			}
		}
	case aclDstdomain:
		// -n: a target given as an address never matches a name.
		if _, err := netip.ParseAddr(r.Host); err == nil || r.Host == "" {
			return false
		}
		host := strings.ToLower(r.Host)
		for _, dom := range d.domains {
			if base, ok := strings.CutPrefix(dom, "."); ok {
				if host == base || strings.HasSuffix(host, dom) {
					return true
				}
			} else if host == dom {
				return true
			}
		}
	}
	return false
}

// valid reports whether header carries the basic credentials of a user of
// the password file.
func (c *Config) valid(header string) bool {
	if header == "" {
		return false
	}
	v := &c.cache
	v.mu.Lock()
	ok, seen := v.ok[header]
	v.mu.Unlock()
	if seen {
		return ok
	}
	ok = c.check(header)
	v.mu.Lock()
	if v.ok == nil || len(v.ok) >= maxRemembered {
		v.ok = map[string]bool{}
	}
	v.ok[header] = ok
	v.mu.Unlock()
	return ok
}

func (c *Config) check(header string) bool {
	scheme, enc, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Basic") {
		return false
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(enc))
	if err != nil {
		return false
	}
	user, pass, ok := strings.Cut(string(b), ":")
	if !ok {
		return false
	}
	hash, known := c.users[user]
	if !known {
		return false
	}
	return sha512_crypt.New().Verify(hash, []byte(pass)) == nil
}
