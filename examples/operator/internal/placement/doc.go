// Package placement decides where a proxy pool's children run: Place
// chooses the entries that get new children when the pool grows, Remove
// the entries that lose children when it shrinks. Both are pure functions
// of plain values (each entry's last Check, the pool's children on it, the
// pool's rules), so a controller and its tests call them alike, and the
// same input gives the same answer whatever the order of the entries.
//
// Place fills the least loaded entry first, one child at a time, among
// the reachable entries that have room for one more proxy; equally loaded
// entries are taken by more free memory, then by name. Remove takes the
// children of unreachable entries first, then from the fullest entry,
// equally full entries by less free memory, then by name. Either way the
// entries that still have room stay within one child of each other,
// unless an entry was already fuller before the call.
//
// Neither moves a child that exists. When an entry comes back after its
// children were replaced elsewhere (3/3/0 for a pool of 6), Place with
// Want 0 gives nothing and Remove of 0 removes nothing: the controller
// restores the spread by surging, one child at a time. Place with Want 1
// puts one on the empty entry (3/3/1); once that child is healthy, Remove
// of 1 takes one from the fullest (2/3/1); and so on to 2/2/2. A move
// helps while the entry Place chooses holds at least two children fewer
// than the fullest reachable entry.
package placement
