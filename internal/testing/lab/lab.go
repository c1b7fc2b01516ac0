package lab

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/sshconn"
)

// Env describes a running lab. Every field is set when Require returns.
type Env struct {
	Dir    string        // EGRESSPROXY_LAB_DIR: the lab's scratch dir
	Script string        // EGRESSPROXY_LAB_SCRIPT: absolute path of scripts/lab
	Name   string        // EGRESSPROXY_LAB_NAME: prefix of the hosts' namespace names
	Rate   string        // EGRESSPROXY_LAB_RATE: link rate per direction, e.g. "1gbit"
	RTT    time.Duration // EGRESSPROXY_LAB_RTT: round-trip time the delay proxies add
	Hosts  []Host        // EGRESSPROXY_LAB_HOSTS of them, Hosts[i].N == i+1
}

// Host describes lab host N; the variables are EGRESSPROXY_LAB_<N>_<NAME>.
type Host struct {
	N             int
	Netns         string // NETNS: its network namespace's name (as the caller's mount namespace sees it)
	Link          string // LINK: the caller's end of its veth pair
	Addr          string // ADDR: its veth address
	CallerAddr    string // CALLER_ADDR: the caller's end of the veth pair, the one address beyond the host its guests reach
	GuestNet      string // GUEST_NET: the subnet of NETWORK (CIDR), routed from the caller via ADDR
	SSHAddr       string // SSH_ADDR: its sshd, over the shaped link
	DelayAddr     string // DELAY_ADDR: 127.0.0.1:PORT, its sshd through the delay proxy
	SSHUser       string // SSH_USER: root
	SSHKey        string // SSH_KEY: authorized client private key file
	KnownHosts    string // KNOWN_HOSTS: pins its host key at SSH_ADDR and DELAY_ADDR
	LibvirtSocket string // LIBVIRT_SOCKET: libvirtd's socket, reachable only inside the host
	LibvirtURI    string // LIBVIRT_URI: qemu:///system
	Pool          string // POOL: an active dir storage pool
	PoolPath      string // POOL_PATH: that pool's directory
	Network       string // NETWORK: an active isolated libvirt network
	StackDir      string // STACK_DIR: the host's scripts/teststack scratch dir
}

// Names of the lab-wide environment variables `scripts/lab env` prints.
const (
	VarDir    = "EGRESSPROXY_LAB_DIR"
	VarScript = "EGRESSPROXY_LAB_SCRIPT"
	VarHosts  = "EGRESSPROXY_LAB_HOSTS"
	VarName   = "EGRESSPROXY_LAB_NAME"
	VarRate   = "EGRESSPROXY_LAB_RATE"
	VarRTT    = "EGRESSPROXY_LAB_RTT"
)

// HostVar is the name of host n's variable suffix, e.g. HostVar(1,
// "SSH_ADDR") is EGRESSPROXY_LAB_1_SSH_ADDR.
func HostVar(n int, suffix string) string {
	return "EGRESSPROXY_LAB_" + strconv.Itoa(n) + "_" + suffix
}

// InCI reports whether the tests run in CI (CI=true), where a missing lab is
// a failure rather than a reason to skip.
func InCI() bool { return os.Getenv("CI") == "true" }

// Require returns the running lab's Env. Without the lab's environment
// (EGRESSPROXY_LAB_HOSTS unset) it fails the test when InCI, and skips it
// otherwise. A partial or malformed environment always fails the test.
func Require(t testing.TB) Env {
	t.Helper()
	if os.Getenv(VarHosts) == "" {
		const how = "`scripts/lab up` and then `eval \"$(scripts/lab env)\"` (docs/lab.md)"
		if InCI() {
			t.Fatalf("lab: the multi-host lab is required in CI (CI=true) but %s is unset; run %s", VarHosts, how)
		}
		t.Skipf("lab: multi-host lab not available (%s unset); run %s", VarHosts, how)
	}
	env, err := fromEnv(os.Getenv)
	if err != nil {
		t.Fatalf("lab: %v", err)
	}
	return env
}

// fromEnv builds an Env from getenv, naming every missing or bad variable.
func fromEnv(getenv func(string) string) (Env, error) {
	var missing, bad []string
	str := func(k string) string {
		v := getenv(k)
		if v == "" {
			missing = append(missing, k)
		}
		return v
	}
	env := Env{Dir: str(VarDir), Script: str(VarScript), Name: str(VarName), Rate: str(VarRate)}
	if v := str(VarRTT); v != "" {
		d, err := parseRTT(v)
		if err != nil {
			bad = append(bad, fmt.Sprintf("%s=%q: %v", VarRTT, v, err))
		}
		env.RTT = d
	}
	k := 0
	if v := str(VarHosts); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 99 {
			bad = append(bad, fmt.Sprintf("%s=%q: must be a host count 1-99", VarHosts, v))
		} else {
			k = n
		}
	}
	for n := 1; n <= k; n++ {
		h := func(s string) string { return str(HostVar(n, s)) }
		env.Hosts = append(env.Hosts, Host{
			N:             n,
			Netns:         h("NETNS"),
			Link:          h("LINK"),
			Addr:          h("ADDR"),
			CallerAddr:    h("CALLER_ADDR"),
			GuestNet:      h("GUEST_NET"),
			SSHAddr:       h("SSH_ADDR"),
			DelayAddr:     h("DELAY_ADDR"),
			SSHUser:       h("SSH_USER"),
			SSHKey:        h("SSH_KEY"),
			KnownHosts:    h("KNOWN_HOSTS"),
			LibvirtSocket: h("LIBVIRT_SOCKET"),
			LibvirtURI:    h("LIBVIRT_URI"),
			Pool:          h("POOL"),
			PoolPath:      h("POOL_PATH"),
			Network:       h("NETWORK"),
			StackDir:      h("STACK_DIR"),
		})
	}
	var msgs []string
	if len(missing) > 0 {
		msgs = append(msgs, "unset: "+strings.Join(missing, ", "))
	}
	msgs = append(msgs, bad...)
	if len(msgs) > 0 {
		return Env{}, fmt.Errorf("incomplete lab environment (load all of `scripts/lab env`): %s", strings.Join(msgs, "; "))
	}
	return env, nil
}

// parseRTT reads scripts/lab's RTT: "0" or a duration in milliseconds.
func parseRTT(v string) (time.Duration, error) {
	if v == "0" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("must be 0 or a duration such as 50ms")
	}
	return d, nil
}

// Libvirt runs fn on a libvirt connection of its own to host h, over its
// link (bounded by 30 s): what a test reads or plants behind the library's
// back.
func (h Host) Libvirt(fn func(*libvirt.Libvirt) error) error {
	pool, err := sshconn.New(sshconn.Config{Address: h.SSHAddr, User: h.SSHUser, KeyFile: h.SSHKey, KnownHostsFile: h.KnownHosts}, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	lv := libvirtconn.New(pool, libvirtconn.Config{Socket: h.LibvirtSocket, URI: h.LibvirtURI}, nil)
	defer lv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return lv.Do(ctx, fn)
}

// PoolVolumes lists every volume of host h's pool, after a refresh, sorted.
func (h Host) PoolVolumes() ([]string, error) {
	var names []string
	err := h.Libvirt(func(l *libvirt.Libvirt) error {
		pool, err := l.StoragePoolLookupByName(h.Pool)
		if err != nil {
			return err
		}
		if err := l.StoragePoolRefresh(pool, 0); err != nil {
			return err
		}
		vols, _, err := l.StoragePoolListAllVolumes(pool, 1, 0)
		for _, v := range vols {
			names = append(names, v.Name)
		}
		return err
	})
	sort.Strings(names)
	return names, err
}
