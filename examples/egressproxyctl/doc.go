// Command egressproxyctl is a thin CLI over the egressproxy library for
// internal tooling and for people: it reads the same config file an
// embedder gives kvm2.Open (several entries = several hypervisors) and runs
// one command against it.
//
//	egressproxyctl [global flags] COMMAND [flags] [args]
//
//	check                          health of each entry, with the reason when unhealthy
//	ls                             proxies of each entry: state, address, UID, age
//	create -name N -uid U [flags]  create one proxy (idempotent on its UID);
//	                               -image, -machine-type, -port, -user-data-file,
//	                               -wait 10m (wait until it runs with an address)
//	delete NAME [-uid U]           delete one proxy, found by name (or by name and UID)
//	images ls                      base images of each entry: key, digest, size, users
//	images verify KEY              read a stored base back and check its digest
//	images evict KEY               remove a stored base no proxy uses
//	probe NAME -target HOST:PORT   a real HTTP CONNECT through the proxy NAME
//	                               (-proxy-user, -proxy-password-file, -expect-body)
//	gc -owner O -keep-file F       delete the owner's proxies whose UID F does not
//	   [-dry-run]                  list (one UID per line, '#' comments)
//
// Global flags: -config FILE (default $EGRESSPROXYCTL_CONFIG), -o table|json,
// -entry NAME (act on one entry), -v N (library logs on stderr), -timeout D.
//
// Tables are for people; -o json prints one JSON document per command on
// stdout for scripts. Notes, progress and errors go to stderr. When stderr
// is a terminal, long calls show a progress line with the elapsed time; a
// create whose image is not cached on the host yet (as reported by
// provider.ImageManager) says that it is fetching the image first, and the
// progress line shows the bytes uploaded so far, of how many, and the rate
// (kvm2.Options.ImageProgress, every second).
//
// Ctrl-C (or SIGTERM) cancels the command's context: the call in flight
// returns promptly, the connections are closed, and the program exits 130.
// A second Ctrl-C kills it at once.
//
// # Exit codes
//
//	0    success
//	1    failure without an error class
//	2    usage: bad flags, arguments or config file
//	3    Transient: retry later (backend unreachable or busy, -timeout passed,
//	     proxy not answering, instance still provisioning)
//	4    Permanent: a human must act (bad spec, refused credentials, image
//	     digest mismatch, image in use, not supported by the provider)
//	5    NotFound: no such instance or image
//	130  canceled: interrupted by Ctrl-C or SIGTERM
//
// When several entries fail, the most severe class wins (canceled, usage,
// Permanent, failure, Transient, NotFound). check exits 3 for an entry that
// is unreachable (or unhealthy for an unknown reason) and 4 for one a human
// must fix (credentials, host key, permissions, pool). probe exits 4 when
// the proxy demands other credentials (407) and 3 for any other failure.
//
// # Config file
//
// JSON or YAML; unknown fields are errors. Each entry is a kvm2.Config in
// camelCase; see docs/config.md for every field. For the project's own test
// stack, scripts/teststack ctl-config prints a ready one.
//
//	entries:
//	  - entry: lab1
//	    owner: tooling
//	    address: 192.0.2.10:22
//	    user: root
//	    keyFile: /home/me/.ssh/id_ed25519
//	    knownHostsFile: /home/me/.ssh/known_hosts
//	    pool: default
//	    images:
//	      debian-12:
//	        url: https://mirror.example/debian-12.qcow2
//	        sha256: <64 hex digits>
package main
