// Package isoseed writes small ISO 9660 images in memory: one root directory
// holding a few small files, with Rock Ridge names. It is made for
// cloud-init's NoCloud seed (volume "cidata" with meta-data, user-data and
// optionally network-config) and touches no file system: no staging
// directory, no TMPDIR.
//
// The image is ECMA-119 with these choices:
//
//   - sectors 0-15 are the (empty) system area, 16 the Primary Volume
//     Descriptor, 17 the Volume Descriptor Set Terminator, 18 and 19 the
//     little- and big-endian path tables, 20 the root directory, 21 the
//     SUSP continuation area holding the Rock Ridge extension reference,
//     and the files' data follow, each from a sector boundary;
//   - file identifiers are the names as given, lowercase, with the "."
//     separator ECMA-119 7.5.1 asks for and version ";1" ("user-data" is
//     recorded as "user-data.;1"): a reader that ignores Rock Ridge (Linux
//     with norock, map=normal or map=off) still sees "user-data";
//   - every directory record carries Rock Ridge (RRIP 1.12) PX entries and
//     each file an NM entry with its exact name; the root's "." record
//     carries the SUSP SP entry and a CE entry pointing at the ER entry
//     ("RRIP_1991A");
//   - the recording times are the Volume's Time (UTC) or "not specified"
//     when it is zero, so equal input gives equal bytes.
package isoseed
