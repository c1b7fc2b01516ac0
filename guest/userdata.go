package guest

import (
	"crypto/rand"
	"crypto/sha256"
	"fmt"

	"github.com/GehirnInc/crypt/sha512_crypt"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/guestconf"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// UserDataOptions configure UserData. A nil *UserDataOptions is valid and
// means the zero value of every field.
type UserDataOptions struct {
	// Salt is any text (an instance's UID, say) from which the salt of
	// each password's hash is derived, per user: the same Salt and Config
	// give the same user-data, so the Spec's digest stays the same from
	// one render to the next, while another password changes it. Empty: a
	// random salt per call (the user-data differs at every call).
	Salt string
}

// saltAlphabet is crypt(3)'s salt alphabet.
const saltAlphabet = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// UserData returns the cloud-init user-data of a guest whose proxy is c
// (see the package doc): a #cloud-config document that writes Squid's
// configuration, the password file (hashes only) and the TLS certificate
// and key. An invalid c gives Validate's error; user-data larger than an
// instance takes is Permanent too.
func UserData(c Config, opts *UserDataOptions) (string, error) {
	if err := c.Validate(); err != nil {
		return "", err
	}
	var o UserDataOptions
	if opts != nil {
		o = *opts
	}
	p := guestconf.Policy{Port: c.Port}
	if p.Port == 0 {
		p.Port = naming.DefaultPort
	}
	for _, u := range c.Users {
		hash, err := sha512_crypt.New().Generate([]byte(u.Password), []byte("$6$"+salt(o.Salt, u.Name)))
		if err != nil {
			return "", errs.Errorf(errs.Permanent, "guest: hash the password of user %s: %v", errs.Quote(u.Name), err)
		}
		p.Users = append(p.Users, guestconf.User{Name: u.Name, Hash: hash})
	}
	for _, s := range c.AllowedClients {
		pr, _ := parseClient(s) // valid: Validate checked it
		p.Clients = append(p.Clients, pr)
	}
	for _, d := range c.AllowedDestinations {
		r := guestconf.Rule{Ports: d.Ports, Domains: d.Domains}
		if len(r.Ports) == 0 {
			r.Ports = []int{443}
		}
		p.Rules = append(p.Rules, r)
	}
	if len(p.Rules) == 0 {
		p.Rules = []guestconf.Rule{{Ports: []int{443}}}
	}
	if c.TLS != nil {
		p.CertPEM, _ = certificates(c.TLS.Certificate)
		p.KeyPEM, _ = privateKey(c.TLS.Key)
	}
	ud, err := guestconf.UserData(p)
	if err != nil {
		return "", errs.Errorf(errs.Permanent, "guest: render the user-data: %v", err)
	}
	if len(ud) > naming.MaxUserDataBytes {
		return "", errs.Errorf(errs.Permanent, "guest: the user-data is %d bytes, more than the %d an instance takes", len(ud), naming.MaxUserDataBytes)
	}
	return ud, nil
}

// salt is the crypt salt of user's hash: 16 characters of crypt's
// alphabet from sha256(seed, user), or random when seed is empty.
func salt(seed, user string) string {
	var sum [32]byte
	if seed == "" {
		_, _ = rand.Read(sum[:])
	} else {
		sum = sha256.Sum256([]byte(fmt.Sprintf("egressproxy guest salt\x00%s\x00%s", seed, user)))
	}
	out := make([]byte, 16)
	for i := range out {
		out[i] = saltAlphabet[sum[i]%64]
	}
	return string(out)
}
