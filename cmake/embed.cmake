# Embeds a file into a C source: cmake -DIN=file -DOUT=file.c -DNAME=sym -P embed.cmake
# defines `const char NAME[]` (NUL-terminated) and `const size_t NAME_len`.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE ${OUT} "/* generated from ${IN} */\n#include <stddef.h>\n"
  "extern const char ${NAME}[];\nextern const size_t ${NAME}_len;\n"
  "const char ${NAME}[] = {${body}0x00};\nconst size_t ${NAME}_len = ${len};\n")
