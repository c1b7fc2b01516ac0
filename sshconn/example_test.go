package sshconn_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/egressproxy/egressproxy/sshconn"
)

// One pooled SSH connection to a hypervisor and a channel to libvirtd's
// unix socket over it: New only builds the pool, the first Client dials.
// Every failure says why as a Kind; here the private key file does not
// exist, which is found before any network use (KindKeyUnreadable).
func Example() {
	dir := "/nonexistent" // where the embedder keeps its key and known_hosts
	pool, err := sshconn.New(sshconn.Config{
		Address:        "127.0.0.1:22",
		User:           "egressproxy",
		KeyFile:        filepath.Join(dir, "id_ed25519"),
		KnownHostsFile: filepath.Join(dir, "known_hosts"),
	}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client, err := pool.Client(ctx)
	if err == nil {
		conn, err := pool.DialUnix(ctx, client, "/var/run/libvirt/libvirt-sock")
		if err == nil {
			defer conn.Close() // speak libvirt's protocol on conn
		}
	}
	var e *sshconn.Error
	if errors.As(err, &e) {
		fmt.Println(e.Kind)
	}

	pool.Close()
	_, err = pool.Client(ctx)
	if errors.As(err, &e) {
		fmt.Println(e.Kind)
	}
	// Output:
	// key unreadable
	// closed
}

// New checks a Config without touching the network or the files; a bad
// one is KindConfig, with one *errs.FieldError per problem, each naming the
// Go field.
func ExampleNew_invalidConfig() {
	cfg := sshconn.Config{Address: "hv1.example.net", User: "egressproxy"} // no port, no key files
	_, err := sshconn.New(cfg, nil)
	var e *sshconn.Error
	if errors.As(err, &e) {
		fmt.Println(e.Kind)
	}
	fmt.Println(err)

	cfg.Address = "hv1.example.net:22"
	cfg.KeyFile, cfg.KnownHostsFile = "/etc/egressproxy/id_ed25519", "/etc/egressproxy/known_hosts"
	pool, err := sshconn.New(cfg, nil)
	fmt.Println(err)
	pool.Close()
	// Output:
	// invalid config
	// sshconn: new pool: invalid config: invalid Address "hv1.example.net": must be host:port
	// invalid KeyFile: a client key is required: set one of KeyFile, Key, AgentSocket or Options.Signer
	// invalid KnownHostsFile: is required, or KnownHosts (host key verification cannot be skipped)
	// <nil>
}

// Credentials held as values, as an operator reads them from a Kubernetes
// Secret: the key (here passphrase-protected) and the known_hosts content
// as bytes, with an @cert-authority line so that every hypervisor whose
// host certificate the CA signed is accepted on port 22. The Config prints
// without its secrets.
func ExampleConfig_credentialsAsValues() {
	secret := map[string][]byte{ // e.g. the Data of a corev1.Secret
		"ssh-privatekey": []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n..."),
		"passphrase":     []byte("do not print me"),
		"known_hosts": []byte("@cert-authority *.hv.example.net ssh-ed25519 " +
			"AAAAC3NzaC1lZDI1NTE5AAAAIDu1Kx+Yl1ZVZqJ8CAbf5m1Qq3uI7FlQ0bwDd0YbOe5s hv-ca\n"),
	}
	cfg := sshconn.Config{
		Address:       "hv1.hv.example.net:22",
		User:          "egressproxy",
		Key:           secret["ssh-privatekey"],
		KeyPassphrase: secret["passphrase"],
		KnownHosts:    secret["known_hosts"],
	}
	pool, err := sshconn.New(cfg, nil)
	fmt.Println(err)
	defer pool.Close()
	fmt.Println(cfg)
	// Output:
	// <nil>
	// sshconn.Config{Address: "hv1.hv.example.net:22", User: "egressproxy", Key: [redacted, 39 bytes], KeyPassphrase: [redacted], KnownHosts: [120 bytes], DialTimeout: 0s, KeepaliveInterval: 0s, KeepaliveCount: 0, MaxRedialBackoff: 0s}
}
