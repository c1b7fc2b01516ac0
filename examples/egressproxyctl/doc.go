// Command egressproxyctl is a CLI over the egressproxy library for
// internal tooling and for people: it reads the config file an embedder
// gives kvm2 (several entries = several hypervisors) and runs one command
// against it, with the conventions of kubectl and gh.
//
//	egressproxyctl COMMAND [ARGS] [flags]
//
//	check                          health of each entry, with the reason when unhealthy
//	ls                             proxies of each entry: state, address, UID, age
//	create NAME --uid UID          create one proxy (idempotent on its UID); --image,
//	                               --machine-type, --port, --user-data-file, --wait 10m
//	delete NAME                    delete one proxy, found by name (or ENTRY/NAME, or --uid)
//	images ls                      base images of each entry: key, digest, size, users
//	images verify KEY              read a stored base back and check its digest
//	images evict KEY               remove a stored base no proxy uses
//	probe NAME --target HOST:PORT  a real HTTP CONNECT through the proxy NAME
//	gc --owner O --keep-file F     delete the owner's proxies whose UID F does not list
//	version                        module version and VCS revision of the binary
//	completion bash|zsh|fish       the shell's completion script
//	help [COMMAND]                 any command's help, with examples
//
// Every command takes the global flags anywhere on the line: --config FILE
// (default $EGRESSPROXYCTL_CONFIG), -o/--output table|json|yaml|name,
// --no-headers, --entry NAME, -v/--verbose N, --timeout D.
//
// Help goes to stdout and exits 0. The command's output goes to stdout;
// notes, progress and one error message go to stderr; a bad flag or
// argument prints one line and a pointer to the command's --help. Exit
// codes follow the error class (egressproxyctl --help lists them): 2
// usage, 3 Transient, 4 Permanent, 5 NotFound, 130 canceled.
package main
